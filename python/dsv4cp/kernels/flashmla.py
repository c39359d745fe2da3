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

`kv` is the dense bf16 rows attention reads. With quantized caches it must be a dequantized
workspace bounded by the chunk (the caller builds it); this module only dispatches.
`DSV4CP_FLASHMLA=off` keeps the Triton kernel (benchmarks compare the two on the same inputs).
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from dsv4cp.kernels import attention as triton_attention

ENV_FLAG = "DSV4CP_FLASHMLA"
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


def flashmla_misfit(q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor) -> str | None:
    """Why FlashMLA's sparse prefill cannot take these inputs, or None when it can."""
    if os.environ.get(ENV_FLAG, "auto").strip().lower() in ("off", "0", "false", "no"):
        return f"{ENV_FLAG}=off"
    mod = flash_mla_module()
    if mod is None:
        return "flash_mla is not installed"
    cap = _capability(q)
    if cap is None or cap[0] not in (9, 10):
        return f"needs SM90 or SM100, got {'no CUDA device' if cap is None else cap}"
    if cap[0] == 9 and not mod.has_legacy():
        return "its SM90 (legacy) kernels are not in this build"
    t, h, d = q.shape
    if h not in HEADS or d != HEAD_DIM:
        return f"it takes H in {HEADS} and D = {HEAD_DIM}, got H={h}, D={d}"
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        return f"it takes bf16 q and kv, got {q.dtype}, {kv.dtype}"
    if kv.stride(1) != 1 or kv.stride(0) % 8:
        return f"kv rows must be contiguous and 16-byte aligned, got strides {kv.stride()}"
    return None


def sparse_attention_backend(q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor) -> str:
    """The backend `sparse_attention` uses for these inputs, with its reason when it is Triton."""
    why = flashmla_misfit(q, kv, indices, sink)
    if why is None:
        mod = flash_mla_module()
        assert mod is not None
        return f"FlashMLA sparse prefill (sgl-flash-mla {_version(mod)})"
    return f"Triton kernel ({why})"


def sparse_attention(q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float) -> Tensor:
    """FlashMLA's sparse prefill where it fits, else the Triton kernel: [T, H, D] in q.dtype."""
    triton_attention.check_sparse_attention(q, kv, indices, sink)
    backend = sparse_attention_backend(q, kv, indices, sink)
    _say_once(f"sparse attention: {backend}")
    if not backend.startswith("FlashMLA"):
        return triton_attention.sparse_attention(q, kv, indices, sink, scale)
    return _flashmla(q, kv, indices, sink, scale)


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
