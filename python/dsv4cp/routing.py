"""The one door through which the layer calls its ops, routed or not.

`ROUTES` names each op that has a Triton kernel: its `dsv4cp.ops` function (the reference, whose
signature and docstring the routed function carries) and the kernels module holding a function
of the same name and signature. A routed call sends CUDA tensors to the kernel unless
`DSV4CP_KERNELS=torch`, and CPU tensors to the op. On CUDA a shape the kernel does not support
raises the kernel's ValueError naming the limit: there is no silent fallback to the op. Kernel
modules are imported on the first CUDA call, so importing this module never imports Triton.

Ops without a kernel are exported here too, so the layer imports every op from one namespace.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from torch import Tensor

from dsv4cp import env_vars, ops
from dsv4cp.ops import (
    apply_rope,
    candidate_blocks,
    grouped_output,
    grouped_wo_a,
    indexer_weights,
    linear_fp32,
    sparse_attention_qat,
    topk_among_blocks,
)

ENV_FLAG = "DSV4CP_KERNELS"
OFF_FLAG = "DSV4CP_KERNELS_OFF"

ROUTES: dict[str, tuple[Callable[..., Any], str]] = {
    "mqa_logits": (ops.mqa_logits, "dsv4cp.kernels.indexer_logits"),
    "mqa_logits_cached": (ops.mqa_logits_cached, "dsv4cp.kernels.indexer_logits_cached"),
    "topk_indices": (ops.topk_indices, "dsv4cp.kernels.topk"),
    # FlashMLA's sparse prefill where installed and the shape fits, else (DSV4CP_GLUON_ATTENTION)
    # kernels.attention_gluon_halves on Hopper, else kernels.attention.
    "sparse_attention": (ops.sparse_attention, "dsv4cp.kernels.flashmla"),
    # FlashMLA over a chunk-bounded bf16 workspace where it fits, else (DSV4CP_GLUON_ATTENTION)
    # the half-buffer Gluon kernel over it on Hopper, else the Triton kernel over a
    # workspace in the model dtype; DSV4CP_FLASHMLA=off: the Triton kernel on the caches (decode
    # on load).
    "sparse_attention_cached": (ops.sparse_attention_cached, "dsv4cp.kernels.flashmla"),
    "swa_key": (ops.swa_key, "dsv4cp.kernels.swa"),
    "store_swa_k": (ops.store_swa_k, "dsv4cp.kernels.swa"),
    # the layer's SWA rows, compressor and index keys: quantized and encoded in the pass
    "swa_key_rows": (ops.swa_key_rows, "dsv4cp.kernels.swa"),
    "compress_entries": (ops.compress_entries, "dsv4cp.kernels.compressor"),
    "store_index_keys": (ops.store_index_keys, "dsv4cp.kernels.compressor"),
    "pair_pool": (ops.pair_pool, "dsv4cp.kernels.compressor"),
    "compressed_latent": (ops.compressed_latent, "dsv4cp.kernels.compressor"),
    "compressed_key": (ops.compressed_key, "dsv4cp.kernels.compressor"),
    "index_key": (ops.index_key, "dsv4cp.kernels.compressor"),
    "rope_index_queries": (ops.rope_index_queries, "dsv4cp.kernels.rope"),
    # the q_lora norm and the blocks' attn / ffn norms: one pass per row, not six
    "rms_norm": (ops.rms_norm, "dsv4cp.kernels.norm"),
    # the q tail and the attention output's inverse: one pass over the tail, in place
    "rope_tail_": (ops.rope_tail_, "dsv4cp.kernels.rope"),
    "fp8_linear": (ops.fp8_linear, "dsv4cp.kernels.fp8_linear"),
    # the routed experts' fp4 weights, chunk by chunk before each grouped GEMM
    "dequant_fp4": (ops.dequant_fp4, "dsv4cp.kernels.fp4_dequant"),
    # the experts' activations in qat: codes × scales in one pass (kernels.fp8_linear)
    "fake_act_quant_fp8": (ops.fake_act_quant_fp8, "dsv4cp.kernels.fp8_linear"),
    # mHC: the streams collapsed into a sublayer's input, and expanded back, one pass each
    "hc_collapse": (ops.hc_collapse, "dsv4cp.kernels.hyper_connections"),
    "hc_expand": (ops.hc_expand, "dsv4cp.kernels.hyper_connections"),
    # the row-local fp32 GEMMs: mHC's mix logits (rms scale folded in) and the MoE gate
    "hc_mix_logits": (ops.hc_mix_logits, "dsv4cp.kernels.rowwise"),
    "rowwise_linear_fp32": (ops.rowwise_linear_fp32, "dsv4cp.kernels.rowwise"),
    # the routed experts' projection, fp4 decoded inside the GEMM (one launch, no host sync)
    "grouped_fp4_mm": (ops.grouped_fp4_mm, "dsv4cp.kernels.moe_fp4_gemm"),
    # mHC's pre / post / Sinkhorn-normalised comb from the mix logits: one launch, not ~80
    "sinkhorn_split": (ops.sinkhorn_split, "dsv4cp.kernels.sinkhorn"),
    # the forward's SWA rows (the window's, the store's): one launch each, not ~20 small ones
    "window_rows": (ops.window_rows, "dsv4cp.kernels.pool_rows"),
    "swa_rows": (ops.swa_rows, "dsv4cp.kernels.pool_rows"),
}

# The indexer's logits fused with their selections (issue 15): the logits never reach memory
# (a plain top-k over ≤ 8K keys, or with a row per ≤ 4 keys, takes the logits route:
# `kernels.indexer_topk.pick_route`).
ROUTES.update(
    {
        "mqa_topk": (ops.mqa_topk, "dsv4cp.kernels.indexer_topk"),
        "mqa_topk_candidates": (ops.mqa_topk_candidates, "dsv4cp.kernels.indexer_topk"),
        "mqa_topk_among_blocks": (ops.mqa_topk_among_blocks, "dsv4cp.kernels.indexer_topk"),
        # the layer's index node: the keys read from the index cache, the role's selection
        "mqa_topk_cached": (ops.mqa_topk_cached, "dsv4cp.kernels.indexer_topk_cached"),
    }
)


def kernel_backend_requested() -> bool:
    """False when DSV4CP_KERNELS=torch forces the ops twins."""
    return bool(env_vars.read(ENV_FLAG) != "torch")


def routes_off() -> frozenset[str]:
    """The routes DSV4CP_KERNELS_OFF (a comma list of ROUTES names) sends to their ops twins on
    CUDA: to bisect a GPU mismatch one kernel at a time (docs/performance.md, "GPU numerics")."""
    names: frozenset[str] = env_vars.read(OFF_FLAG)
    unknown = sorted(names - ROUTES.keys())
    if unknown:
        raise env_vars.EnvVarError(f"{OFF_FLAG}: unknown routes {unknown}; known: {sorted(ROUTES)}")
    return names


def check_environment() -> list[str]:
    """`env_vars.check_environment` (EnvVarError on a bad value; the unknown-name warnings) and
    DSV4CP_KERNELS_OFF's names against the routes: what the CLI and the SGLang plugin check at
    start."""
    warnings = env_vars.check_environment()
    routes_off()
    return warnings


def use_kernels(x: Tensor, name: str | None = None) -> bool:
    """Whether an op whose first tensor is `x` (the route `name`, if given) runs its Triton
    kernel."""
    return x.is_cuda and kernel_backend_requested() and (name is None or name not in routes_off())


def kernel_of(name: str) -> Callable[..., Any]:
    """The Triton twin of the routed op `name` (imports its kernels module)."""
    return getattr(importlib.import_module(ROUTES[name][1]), name)


def _route(name: str) -> Callable[..., Any]:
    op = ROUTES[name][0]
    lead = next(iter(inspect.signature(op).parameters))  # the tensor that picks the device

    @functools.wraps(op)
    def routed(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else kwargs[lead]
        return (kernel_of(name) if use_kernels(first, name) else op)(*args, **kwargs)

    return routed


mqa_logits = _route("mqa_logits")
mqa_logits_cached = _route("mqa_logits_cached")
topk_indices = _route("topk_indices")
sparse_attention = _route("sparse_attention")
sparse_attention_cached = _route("sparse_attention_cached")
swa_key = _route("swa_key")
store_swa_k = _route("store_swa_k")
swa_key_rows = _route("swa_key_rows")
compress_entries = _route("compress_entries")
store_index_keys = _route("store_index_keys")
pair_pool = _route("pair_pool")
compressed_latent = _route("compressed_latent")
compressed_key = _route("compressed_key")
index_key = _route("index_key")
rope_index_queries = _route("rope_index_queries")
rms_norm = _route("rms_norm")
rope_tail_ = _route("rope_tail_")
fp8_linear = _route("fp8_linear")
dequant_fp4 = _route("dequant_fp4")
fake_act_quant_fp8 = _route("fake_act_quant_fp8")
hc_collapse = _route("hc_collapse")
hc_expand = _route("hc_expand")
hc_mix_logits = _route("hc_mix_logits")
rowwise_linear_fp32 = _route("rowwise_linear_fp32")
grouped_fp4_mm = _route("grouped_fp4_mm")
sinkhorn_split = _route("sinkhorn_split")
window_rows = _route("window_rows")
swa_rows = _route("swa_rows")
mqa_topk = _route("mqa_topk")
mqa_topk_candidates = _route("mqa_topk_candidates")
mqa_topk_among_blocks = _route("mqa_topk_among_blocks")
mqa_topk_cached = _route("mqa_topk_cached")

__all__ = [
    "ENV_FLAG",
    "OFF_FLAG",
    "ROUTES",
    "check_environment",
    "apply_rope",
    "candidate_blocks",
    "compress_entries",
    "compressed_key",
    "compressed_latent",
    "dequant_fp4",
    "fake_act_quant_fp8",
    "fp8_linear",
    "grouped_fp4_mm",
    "grouped_output",
    "grouped_wo_a",
    "hc_collapse",
    "hc_expand",
    "hc_mix_logits",
    "index_key",
    "indexer_weights",
    "kernel_backend_requested",
    "kernel_of",
    "linear_fp32",
    "mqa_logits",
    "mqa_logits_cached",
    "mqa_topk",
    "mqa_topk_among_blocks",
    "mqa_topk_cached",
    "mqa_topk_candidates",
    "pair_pool",
    "rms_norm",
    "rope_index_queries",
    "rope_tail_",
    "routes_off",
    "rowwise_linear_fp32",
    "sinkhorn_split",
    "sparse_attention",
    "sparse_attention_cached",
    "sparse_attention_qat",
    "store_index_keys",
    "store_swa_k",
    "swa_key",
    "swa_key_rows",
    "swa_rows",
    "topk_among_blocks",
    "topk_indices",
    "use_kernels",
    "window_rows",
]
