"""Sparse attention on CUDA: FlashMLA's sparse prefill where it is installed and takes the shape,
else the portable Triton kernel (`kernels/attention.py`). The choice is said once in the log per
backend and reason ("sparse attention: FlashMLA sparse prefill (sgl-flash-mla 1.0.0)"), never
made silently.

FlashMLA (`flash_mla.flash_mla_sparse_fwd`, the `sgl-flash-mla` wheel SGLang 0.5.23 uses) takes:
q bf16 [T, H, 512] with H ∈ {64, 128} and each token's heads contiguous; kv bf16 [N, 1, 512]
(MQA, K = V); indices int32 [T, 1, K] with K a multiple of 64 (the SM90 kernel's key block;
shorter rows are padded with -1 here), -1 or ≥ N = skip; attn_sink fp32 [H]. On SM90 it needs
the legacy kernels (`use_legacy=True`); on SM100 the current ones. The math is the op's: the sink
adds e^{sink} to the softmax denominator with no value vector.

Where FlashMLA does not run, the half-buffer Gluon sm_90 kernel
(`kernels/attention_gluon_halves.py`, FlashMLA's schedule in Gluon) takes its place on Hopper at
64 heads × 512 bf16: it takes what FlashMLA takes, one dense bf16 source and indices, so it reads
the same workspace — 0.89 of FlashMLA's speed on the kernel benchmark's shape and 0.84–0.92 on
the layers' rows of a 16K chunk after 112K (H100, docs/performance.md §30).
`DSV4CP_GLUON_ATTENTION` (`gluon_misfit`): auto, the default, does so where FlashMLA is not
installed or does not take the query, but not under `DSV4CP_FLASHMLA=off`; on also there; off
never.

`sparse_attention` takes the dense bf16 rows attention reads. `sparse_attention_cached` (the
layer's call, routed here) reads the caches in their storage formats: per chunk of query rows it
decodes the rows the chunk's indices name, each once, into a workspace of static size (no host
sync: rows marked, numbered by a prefix sum, indices remapped; `kernels/attention_workspace.py`,
`build_workspace`) and runs FlashMLA or the Gluon kernel over it (bf16); where neither runs, the
Triton cached kernel's math over a workspace in the model dtype (`triton_over_workspace`: the
decode is exact, so the result is the kernel's on the caches, ~9× faster than its decode on
load, §25). The chunk is bounded by `attention_workspace.WORKSPACE_BUDGET_BYTES`
(docs/performance.md has the memory at 16K-token chunks up to 1M context). `DSV4CP_FLASHMLA=off`
keeps the Triton kernels, the cached one on the caches in place: the reference's qat order for
`tools/reference_check` (benchmarks compare them on the same inputs).
"""

from __future__ import annotations

import enum
import importlib
import logging
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from dsv4cp import env_vars
from dsv4cp.kernels import attention as triton_attention
from dsv4cp.kernels import attention_gluon, attention_gluon_halves
from dsv4cp.kernels.attention_workspace import over_workspace
from dsv4cp.ops.quant import QuantMode, check_quant_mode
from dsv4cp.ops.workspace_rows import WorkspaceMemo

ENV_FLAG = "DSV4CP_FLASHMLA"
GLUON_ENV = "DSV4CP_GLUON_ATTENTION"
HEADS = (64, 128)
HEAD_DIM = 512
TOPK_ALIGN = 64

log = logging.getLogger("dsv4cp.kernels")
_said: set[str] = set()
_module: list[ModuleType | None] = []  # [flash_mla or None] once imported


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        log.info(message)


def flash_mla_module() -> ModuleType | None:
    """`flash_mla` when it imports (once per process), else None."""
    if not _module:
        try:
            _module.append(importlib.import_module("flash_mla"))
        except ImportError:
            _module.append(None)
    return _module[0]


def _capability(x: Tensor) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(x.device) if x.is_cuda else None


def _version(mod: ModuleType) -> str:
    return str(getattr(mod, "__version__", "unknown version"))


def _is_off(flag: str) -> bool:
    """Whether an on/off variable (`DSV4CP_FLASHMLA`, `DSV4CP_GLUON_ATTENTION`) reads off."""
    return env_vars.read(flag) in ("off", "0", "false", "no")


def _flashmla_off() -> bool:
    return _is_off(ENV_FLAG)


def _query_misfit(q: Tensor) -> str | None:
    """Why FlashMLA cannot take this query (or this process), or None."""
    if _flashmla_off():
        return f"{ENV_FLAG}=off"
    mod = flash_mla_module()
    if mod is None:
        return "flash_mla is not installed"
    cap = _capability(q)
    if cap is None or cap[0] not in (9, 10):
        return f"needs SM90 or SM100, got {'no CUDA device' if cap is None else cap}"
    if cap[0] == 9 and not mod.has_legacy():
        return "its SM90 (legacy) kernels are not in this build"
    if q.dim() != 3:
        return f"q must be [T, H, D], got {tuple(q.shape)}"
    t, h, d = q.shape
    if h not in HEADS or d != HEAD_DIM:
        return f"it takes H in {HEADS} and D = {HEAD_DIM}, got H={h}, D={d}"
    if q.dtype != torch.bfloat16:
        return f"it takes bf16 q, got {q.dtype}"
    return None


def gluon_misfit(q: Tensor) -> str | None:
    """Why the Gluon sm_90 kernel cannot stand in for FlashMLA here, or None when it can.
    `DSV4CP_GLUON_ATTENTION`: auto (the default) stands in where FlashMLA is not installed or
    does not take the query, but not where `DSV4CP_FLASHMLA=off` asked for the Triton kernels
    (the reference-exact qat path, `tools/reference_check`); on also there; off never."""
    if _is_off(GLUON_ENV):
        return f"{GLUON_ENV}=off"
    if env_vars.read(GLUON_ENV) == "auto" and _flashmla_off():
        return f"{ENV_FLAG}=off keeps the Triton kernels ({GLUON_ENV}=on takes Gluon there)"
    why = attention_gluon.kernel_misfit(q, _capability(q))
    if why is None and q.dtype != torch.bfloat16:
        return f"the Gluon kernel takes bf16 q, got {q.dtype}"
    return why


def _stand_in(why: str) -> str:
    """The Gluon backend's name where FlashMLA does not run (`why`) and Gluon can."""
    return f"Gluon sm_90 half-buffer kernel (FlashMLA: {why})"


def flashmla_misfit(q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor) -> str | None:
    """Why FlashMLA's sparse prefill cannot take these inputs, or None when it can."""
    why = _query_misfit(q)
    if why is not None:
        return why
    if kv.dtype != torch.bfloat16:
        return f"it takes bf16 q and kv, got {q.dtype}, {kv.dtype}"
    if kv.stride(1) != 1 or kv.stride(0) % 8:
        return f"kv rows must be contiguous and 16-byte aligned, got strides {kv.stride()}"
    return None


class Backend(enum.Enum):
    """The sparse-attention backends this module chooses between (the log line names them)."""

    FLASHMLA = "FlashMLA sparse prefill"
    GLUON = "the Gluon sm_90 half-buffer kernel"
    TRITON = "the Triton kernel (dense rows)"
    TRITON_CACHED = "the Triton cached kernel on the caches"
    TRITON_OVER_WORKSPACE = "the Triton cached kernel over a workspace"


def _choice(q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor) -> tuple[Backend, str]:
    """`sparse_attention`'s backend for these inputs and its log description (with the reason
    where it is not FlashMLA)."""
    why = flashmla_misfit(q, kv, indices, sink)
    if why is None:
        mod = flash_mla_module()
        assert mod is not None
        return Backend.FLASHMLA, f"FlashMLA sparse prefill (sgl-flash-mla {_version(mod)})"
    if kv.dtype == torch.bfloat16 and gluon_misfit(q) is None:
        return Backend.GLUON, _stand_in(why)
    return Backend.TRITON, f"Triton kernel ({why})"


def sparse_attention_backend(q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor) -> str:
    """The backend `sparse_attention` uses for these inputs, with its reason when it is Triton."""
    return _choice(q, kv, indices, sink)[1]


def sparse_attention(q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float) -> Tensor:
    """FlashMLA's sparse prefill where it fits, else the Triton kernel: [T, H, D] in q.dtype."""
    triton_attention.check_sparse_attention(q, kv, indices, sink)
    backend, description = _choice(q, kv, indices, sink)
    _say_once(f"sparse attention: {description}")
    if backend is Backend.TRITON:
        return triton_attention.sparse_attention(q, kv, indices, sink, scale)
    return _workspace_kernel(backend)(q, kv, indices, sink, scale)


def _workspace_kernel(
    backend: Backend,
) -> Callable[[Tensor, Tensor, Tensor, Tensor, float], Tensor]:
    """The kernel over one dense bf16 source: FlashMLA's or the Gluon one."""
    return _flashmla if backend is Backend.FLASHMLA else _gluon


def _gluon(q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float) -> Tensor:
    return attention_gluon_halves.sparse_attention_gluon_halves(q, kv, indices, sink, scale)


def _flashmla(q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float) -> Tensor:
    mod = flash_mla_module()
    assert mod is not None
    t, h, d = q.shape
    if t == 0:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    idx = indices.to(torch.int32)
    pad = -idx.shape[1] % TOPK_ALIGN
    if pad or idx.shape[1] == 0:
        idx = F.pad(idx, (0, pad or TOPK_ALIGN), value=-1)
    cap = _capability(q)
    out, _, _ = mod.flash_mla_sparse_fwd(
        q,
        kv.unsqueeze(1),
        idx.contiguous().unsqueeze(1),
        float(scale),
        HEAD_DIM,
        attn_sink=sink.float().contiguous(),
        use_legacy=cap is not None and cap[0] == 9,
        return_log2_lse=False,
    )
    return out


# ----------------------------------------------------------------- over the quantized caches


def _cached_choice(q: Tensor) -> tuple[Backend, str]:
    """`sparse_attention_cached`'s backend for this query and its log description."""
    why = _query_misfit(q)
    if why is None:
        mod = flash_mla_module()
        assert mod is not None
        return Backend.FLASHMLA, (
            f"FlashMLA sparse prefill over a bf16 workspace (sgl-flash-mla {_version(mod)})"
        )
    gluon_why = gluon_misfit(q)
    if gluon_why is None:
        return Backend.GLUON, f"{_stand_in(why)} over a bf16 workspace"
    if _flashmla_off():
        return Backend.TRITON_CACHED, f"Triton cached kernel ({why})"
    return Backend.TRITON_OVER_WORKSPACE, (
        f"{TRITON_OVER_WORKSPACE} (FlashMLA: {why}; Gluon: {gluon_why})"
    )


def sparse_attention_cached_backend(q: Tensor) -> str:
    """The backend `sparse_attention_cached` uses for this query, with its reason when Triton."""
    return _cached_choice(q)[1]


# The portable path where neither FlashMLA nor Gluon runs: the Triton cached kernel's math over
# the workspace's decoded rows (exact in the model dtype), 9x its decode on load (§25).
TRITON_OVER_WORKSPACE = "Triton kernel over a workspace"


def triton_over_workspace(
    k_swa: int, quant: QuantMode
) -> Callable[[Tensor, Tensor, Tensor, Tensor, float], Tensor]:
    """The Triton cached kernel over a workspace whose first `k_swa` index columns are the
    window's, with the cached kernel's result over the same decoded values. In qat the
    workspace's one index list [window | top-k] goes in as one list: the reference's 64-key
    blocks over it are the ones the kernel walks over the two lists concatenated, and one list
    pipelines like the dense kernel (two stages, one load per block; §25). In none the two
    lists stay two sources, as the kernel walks them on the caches."""
    one_list = check_quant_mode(quant) == "qat"

    def attend(q: Tensor, kv: Tensor, idx: Tensor, sink: Tensor, scale: float) -> Tensor:
        if one_list or idx.shape[1] == k_swa:
            return triton_attention.sparse_attention_cached(
                q, kv, idx, None, None, sink, scale, "dense", "dense", quant
            )
        return triton_attention.sparse_attention_cached(
            q, kv, idx[:, :k_swa], kv, idx[:, k_swa:], sink, scale, "dense", "dense", quant
        )

    return attend


def sparse_attention_cached(
    q: Tensor,
    swa: Tensor,
    swa_indices: Tensor,
    comp: Tensor | None,
    comp_indices: Tensor | None,
    sink: Tensor,
    scale: float,
    swa_format: str = "dense",
    comp_format: str = "dense",
    quant: QuantMode = "none",
    *,
    workspace_rows: tuple[int, int] | None = None,
    workspace_memo: WorkspaceMemo | None = None,
    comp_rows: Tensor | None = None,
) -> Tensor:
    """Twin of ops.attention.sparse_attention_cached on CUDA: FlashMLA's sparse prefill over a
    chunk-bounded bf16 workspace where FlashMLA takes the query, else the Gluon kernel over it on
    Hopper, else the Triton cached kernel over a workspace in the model dtype, or on the caches
    under `DSV4CP_FLASHMLA=off` (said once in the log, with the reasons). `workspace_rows` =
    (SWA rows, compressed rows): upper bounds on the distinct rows the indices name (the layer
    knows them from the batch).
    `workspace_memo`: a one-chunk workspace is kept there and reused by a later call with the
    same index tensors, or the same `comp_rows` (`attention_workspace.build_workspace`).
    `comp_rows` [N]: every compressed cache row the batch has (its entries'; `comp_indices` name
    no other row): where a chunk may name N rows, all N are decoded and numbered in list order
    (dense), so a later layer reading the same cache through another top-k reuses the decode."""
    triton_attention.check_sparse_attention_cached(
        q, swa, swa_indices, comp, comp_indices, sink, swa_format, comp_format
    )
    backend, description = _cached_choice(q)
    _say_once(f"sparse attention: {description}")
    if backend is Backend.TRITON_CACHED:
        return triton_attention.sparse_attention_cached(
            q, swa, swa_indices, comp, comp_indices, sink, scale, swa_format, comp_format, quant
        )
    check_quant_mode(quant)  # FlashMLA's order (and Gluon's) is one for both modes
    if backend is Backend.TRITON_OVER_WORKSPACE:  # the decode is exact in the model dtype
        attend, dtype = triton_over_workspace(swa_indices.shape[1], quant), q.dtype
    else:
        attend, dtype = _workspace_kernel(backend), torch.bfloat16
    return over_workspace(attend, dtype, q, swa, swa_indices, comp, comp_indices, sink, scale,
                          swa_format, comp_format, workspace_rows=workspace_rows,
                          workspace_memo=workspace_memo, comp_rows=comp_rows)  # fmt: skip
