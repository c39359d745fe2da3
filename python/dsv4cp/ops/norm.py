"""RMSNorm in fp32."""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(
    x: Tensor,
    weight: Tensor | None,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """x · rsqrt(mean(x², -1) + eps) · weight, computed in fp32; returns out_dtype or x.dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(out_dtype or x.dtype)
