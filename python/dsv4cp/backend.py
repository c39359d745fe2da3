"""The ops the model calls, routed to Triton kernels on CUDA or to `dsv4cp.ops` (CPU, or
`DSV4CP_KERNELS=torch`). The model imports ops only through this module."""

from __future__ import annotations

from dsv4cp.ops import (  # noqa: F401
    apply_rope,
    candidate_blocks,
    mqa_logits,
    sparse_attention,
    store_swa_k,
    topk_among_blocks,
    topk_indices,
)
