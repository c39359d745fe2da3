"""Route each hot op to its Triton kernel or to its `dsv4cp.ops` twin.

CUDA tensors go to the kernel unless `DSV4CP_KERNELS=torch`; CPU tensors always go to ops. On
CUDA a shape the kernel does not support raises ValueError naming the limit: there is no silent
fallback to ops.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from dsv4cp.ops.rope import YarnScaling

ENV_FLAG = "DSV4CP_KERNELS"


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_backend_requested() -> bool:
    """False when DSV4CP_KERNELS=torch forces the ops twins."""
    value = os.environ.get(ENV_FLAG, "triton").strip().lower()
    if value not in ("triton", "torch", ""):
        raise ValueError(f"{ENV_FLAG} must be 'triton' or 'torch', got {value!r}")
    return value != "torch"


def use_kernels(x: Tensor) -> bool:
    """Whether an op on `x` runs the Triton kernel."""
    return x.is_cuda and kernel_backend_requested()


def mqa_logits(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    n_visible: Tensor,
    *,
    k_start: Tensor | None = None,
    width: int | None = None,
) -> Tensor:
    """fp32 [T, width]: Σ_h weights·relu(q·k[k_start+j]) for j < n_visible, else -inf."""
    if use_kernels(q):
        from dsv4cp.kernels.mqa_logits import mqa_logits as kernel

        return kernel(q, weights, k, n_visible, k_start=k_start, width=width)
    from dsv4cp.ops.indexer import mqa_logits as op

    return op(q, weights, k, n_visible, k_start=k_start, width=width)


def topk_indices(logits: Tensor, n_visible: Tensor, k: int) -> Tensor:
    """int32 [T, k]: the k largest of each row's visible prefix, sorted ascending, -1 pads."""
    if use_kernels(logits):
        from dsv4cp.kernels.topk import topk_indices as kernel

        return kernel(logits, n_visible, k)
    from dsv4cp.ops.indexer import topk_indices as op

    return op(logits, n_visible, k)


def mqa_topk(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    n_visible: Tensor,
    k_top: int,
    *,
    k_start: Tensor | None = None,
    width: int | None = None,
    max_logits_bytes: int = 1 << 30,
) -> Tensor:
    """topk_indices(mqa_logits(...)) computed in row chunks whose logits fit max_logits_bytes.

    Rows are independent, so the chunking does not change the result; only one chunk of fp32
    logits [rows, width] is alive at a time.
    """
    t = q.shape[0]
    w = k.shape[0] if width is None else width
    rows = max(1, min(t, max_logits_bytes // max(1, 4 * w)))
    out = torch.empty((t, k_top), dtype=torch.int32, device=q.device)
    for r0 in range(0, t, rows):
        r1 = min(t, r0 + rows)
        ks = None if k_start is None else k_start[r0:r1]
        logits = mqa_logits(q[r0:r1], weights[r0:r1], k, n_visible[r0:r1], k_start=ks, width=w)
        out[r0:r1] = topk_indices(logits, n_visible[r0:r1], k_top)
    return out


def sparse_attention(
    q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float
) -> Tensor:
    """[T, H, D] q.dtype: softmax over kv[indices] (−1 skipped) with a per-head sink logit."""
    if use_kernels(q):
        from dsv4cp.kernels.sparse_attention import sparse_attention as kernel

        return kernel(q, kv, indices, sink, scale)
    from dsv4cp.ops.attention import sparse_attention as op

    return op(q, kv, indices, sink, scale)


def swa_key(
    kv_raw: Tensor,
    positions: Tensor,
    norm_weight: Tensor | None,
    eps: float,
    rope_dim: int,
    theta: float,
    yarn: YarnScaling | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """apply_rope(rms_norm(kv_raw)) [T, D] in fp32, cast once to out_dtype."""
    if use_kernels(kv_raw):
        from dsv4cp.kernels.swa_store import swa_key as kernel

        return kernel(kv_raw, positions, norm_weight, eps, rope_dim, theta, yarn, out_dtype)
    from dsv4cp.ops.swa import swa_key as op

    return op(kv_raw, positions, norm_weight, eps, rope_dim, theta, yarn, out_dtype)


def store_swa_k(
    kv_raw: Tensor,
    positions: Tensor,
    slots: Tensor,
    cache: Tensor,
    norm_weight: Tensor | None,
    eps: float,
    rope_dim: int,
    theta: float,
    yarn: YarnScaling | None = None,
) -> None:
    """cache[slots] = swa_key(...) cast to cache.dtype (writes `cache`)."""
    if use_kernels(kv_raw):
        from dsv4cp.kernels.swa_store import store_swa_k as kernel

        kernel(kv_raw, positions, slots, cache, norm_weight, eps, rope_dim, theta, yarn)
        return
    from dsv4cp.ops.swa import store_swa_k as op

    op(kv_raw, positions, slots, cache, norm_weight, eps, rope_dim, theta, yarn)


def pair_pool(kv: Tensor, gate: Tensor, partner_kv: Tensor, partner_gate: Tensor) -> Tensor:
    """fp32 [T, D] per-channel softmax pooling of (partner = even token, row = odd token)."""
    if use_kernels(kv):
        from dsv4cp.kernels.compressor import pair_pool as kernel

        return kernel(kv, gate, partner_kv, partner_gate)
    from dsv4cp.ops.compressor import pair_pool as op

    return op(kv, gate, partner_kv, partner_gate)


def compressed_latent(
    pooled_or_kv: Tensor, norm_weight: Tensor | None, eps: float, dtype: torch.dtype
) -> Tensor:
    """rms_norm(pooled rounded to dtype) in dtype [n, D]."""
    if use_kernels(pooled_or_kv):
        from dsv4cp.kernels.compressor import compressed_latent as kernel

        return kernel(pooled_or_kv, norm_weight, eps, dtype)
    from dsv4cp.ops.compressor import compressed_latent as op

    return op(pooled_or_kv, norm_weight, eps, dtype)


def compressed_key(
    latent: Tensor,
    entry_positions: Tensor,
    rope_dim: int,
    theta: float,
    yarn: YarnScaling | None = None,
) -> Tensor:
    """apply_rope(latent, entry_positions) in latent.dtype."""
    if use_kernels(latent):
        from dsv4cp.kernels.compressor import compressed_key as kernel

        return kernel(latent, entry_positions, rope_dim, theta, yarn)
    from dsv4cp.ops.compressor import compressed_key as op

    return op(latent, entry_positions, rope_dim, theta, yarn)


def index_key(
    latent: Tensor,
    wk: Tensor,
    k_norm_weight: Tensor | None,
    eps: float,
    entry_positions: Tensor,
    rope_dim: int,
    theta: float,
    yarn: YarnScaling | None = None,
) -> Tensor:
    """rope(rms_norm(latent @ wkᵀ)) [n, D_I] in latent.dtype."""
    if use_kernels(latent):
        from dsv4cp.kernels.compressor import index_key as kernel

        return kernel(latent, wk, k_norm_weight, eps, entry_positions, rope_dim, theta, yarn)
    from dsv4cp.ops.compressor import index_key as op

    return op(latent, wk, k_norm_weight, eps, entry_positions, rope_dim, theta, yarn)


def compress_store(
    kv: Tensor,
    gate: Tensor | None,
    partner_kv: Tensor | None,
    partner_gate: Tensor | None,
    entry_positions: Tensor,
    slots: Tensor,
    cache: Tensor,
    norm_weight: Tensor | None,
    eps: float,
    rope_dim: int,
    theta: float,
    yarn: YarnScaling | None = None,
) -> Tensor:
    """Ratio-1/2 compressor tail: cache[slots] = compressed_key(latent); returns the latent.

    Ratio 2 passes gate and the partner rows (pair_pool first); ratio 1 passes gate = partner_kv =
    partner_gate = None and kv is the bf16 projection. latent is in cache.dtype.
    """
    if use_kernels(kv):
        from dsv4cp.kernels.compressor import compress_store as kernel

        return kernel(
            kv, gate, partner_kv, partner_gate, entry_positions, slots, cache, norm_weight, eps,
            rope_dim, theta, yarn,
        )
    from dsv4cp.ops import compressor as op

    pooled = kv if gate is None else op.pair_pool(kv, gate, partner_kv, partner_gate)
    latent = op.compressed_latent(pooled, norm_weight, eps, cache.dtype)
    key = op.compressed_key(latent, entry_positions, rope_dim, theta, yarn)
    cache.index_copy_(0, slots.long(), key.to(cache.dtype))
    return latent
