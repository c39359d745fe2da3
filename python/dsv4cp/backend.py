"""The ops the model calls: Triton kernels on CUDA (`dsv4cp.kernels.dispatch`), `dsv4cp.ops`
on CPU or with `DSV4CP_KERNELS=torch`. The model imports routed ops only through this module;
ops without a kernel (RoPE on Q, candidate selection) always run their torch version."""

from __future__ import annotations

from dsv4cp.kernels.dispatch import (  # noqa: F401
    compressed_key,
    compressed_latent,
    index_key,
    mqa_logits,
    pair_pool,
    sparse_attention,
    store_swa_k,
    topk_indices,
)
from dsv4cp.ops import apply_rope, candidate_blocks, topk_among_blocks  # noqa: F401


def rope_tail_(x, positions, rope_dim, theta, yarn=None, inverse=False):  # noqa: ANN001, ANN201
    """In-place `apply_rope`: rotates only the last `rope_dim` dims of x, leaving the rest
    untouched (1/8 of the traffic of a full functional copy at D = 512). Same numerics."""
    tail = x[..., x.shape[-1] - rope_dim :]
    tail.copy_(apply_rope(tail, positions, rope_dim, theta, yarn, inverse=inverse))
    return x
