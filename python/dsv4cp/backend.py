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
