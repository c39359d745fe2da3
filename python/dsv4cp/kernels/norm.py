"""Triton twin of `ops.norm.rms_norm`: the shared norm/RoPE row kernel (`kernels.norm_rope`) with
RoPE off — one read and one write per row, where the torch op makes about six passes (the fp32
copy, the square, the mean, the product, the weight's product, the cast). Rows up to the
kernel's MAX_D (8192) columns: the model's widest is the hidden size, 5120.

Numerics: the same fp32 steps in the same order (x · rsqrt(mean(x²) + eps) · w, one rounding to
the output dtype) except the sum of squares, which the kernel adds as a tree where torch's mean
reduces in its own order: the fp32 results differ by rounding, so an output can rarely sit one
rounding away from the twin's. Each row's result depends on that row only (the tree is the
same for every row and every row count), so CP and chunked runs still equal CP = 1.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4cp.kernels.norm_rope import norm_rope_rows


def rms_norm(
    x: Tensor,
    weight: Tensor | None,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """x · rsqrt(mean(x², -1) + eps) · weight in fp32, one rounding to out_dtype (or x.dtype)."""
    d = x.shape[-1]
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    norm_rope_rows(
        x.reshape(-1, d),
        out.view(-1, d),
        positions=None,
        rope_dim=0,
        theta=0.0,
        yarn=None,
        norm_weight=weight,
        eps=eps,
    )
    return out
