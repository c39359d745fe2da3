"""GEMMs with an fp32 result from bf16 operands, and CPU GEMMs whose rows are local."""

from __future__ import annotations

from typing import Final

import torch
import torch.nn.functional as F
from torch import Tensor

# A CPU BLAS may pick its kernel, and so a row's fp32 summation order, by the row count: MKL
# 2024.2 (torch 2.14's) with AVX2 on an AMD EPYC takes another sgemm kernel below 12 rows unless a
# multiple of 4, so a token's row differed in the last bit between a CP rank's or an expert's few
# rows and the whole batch (and the CP = N / EP = N equality tests failed on such a machine). CPU
# calls therefore get at least CPU_MIN_ROWS rows (zero rows appended, dropped after): measured
# row for row equal to a 150-row call at any offset for 1–129 rows, K and N from 7 to 5120.
CPU_MIN_ROWS = 16


def pad_rows_cpu(x: Tensor) -> tuple[Tensor, int]:
    """(x [M, ...] with zero rows appended up to CPU_MIN_ROWS when on the CPU, M)."""
    m = x.shape[0]
    if x.is_cuda or m == 0 or m >= CPU_MIN_ROWS:
        return x, m
    return torch.cat([x, x.new_zeros(CPU_MIN_ROWS - m, *x.shape[1:])]), m


def linear_rows(x: Tensor, w: Tensor) -> Tensor:
    """F.linear(x, w) for x [..., K], w [N, K]; on the CPU every call has ≥ CPU_MIN_ROWS rows."""
    if x.is_cuda or x.dim() < 1:
        return F.linear(x, w)
    rows, m = pad_rows_cpu(x.reshape(-1, x.shape[-1]))
    return F.linear(rows, w)[:m].reshape(*x.shape[:-1], w.shape[0])


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
    return linear_rows(x.float(), w.float())
