"""GEMMs with an fp32 result from bf16 operands."""

from __future__ import annotations

from typing import Final

import torch
from torch import Tensor


def _mm_has_out_dtype() -> bool:
    """Whether this torch offers `torch.mm(a, b, out_dtype=torch.float32)` for bf16 operands
    (probed once, on meta tensors: no device work)."""
    a = torch.empty(1, 1, dtype=torch.bfloat16, device="meta")
    try:
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


MM_OUT_DTYPE: Final[bool] = _mm_has_out_dtype()


def linear_fp32(x: Tensor, w: Tensor) -> Tensor:
    """x [T, K] · wᵀ [K, N] → fp32 [T, N] from bf16/fp32 operands (SGLang's linear_bf16_fp32).

    bf16 CUDA operands use cuBLAS's bf16 → fp32 GEMM when torch has it (one rounding, of the fp32
    sum); otherwise both operands are upcast first, which gives the same products in fp32.
    """
    if MM_OUT_DTYPE and x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16:
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    return x.float() @ w.float().t()
