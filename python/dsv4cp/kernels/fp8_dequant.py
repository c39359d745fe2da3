"""fp8 weights with 32×32 block scales dequantized in one Triton pass (the cuBLAS projection
path's per-call weight operand, `kernels.fp8_linear.dequant_mm`).

Twin: `dsv4cp.ops.linear.dequant_fp8_blocks` (same signature). Each program reads BLOCK_R rows ×
BLOCK_K columns of e4m3 codes and their block scales and writes code × scale in out_dtype. e8m0
scales are read as their bytes and decoded in the kernel as `ops.quant.e8m0_to_float` does
(2^(b−127); b = 0 is fp32's subnormal 2^−127, b = 255 NaN): the host conversion it replaces
was seven small launches per call (~12 µs on the H200 at any weight size, docs/performance.md
§13); other scale dtypes are converted to fp32 on the host. An e4m3 value times
a power of two is exact in fp32 and in bf16, so the result equals the twin's bit for bit (for
scales ≥ 2⁻¹¹⁶; smaller ones give subnormal outputs, which the conversion may flush to zero).
The torch form it replaces in `dequant_mm` made two passes (the e4m3 → bf16 cast, then the
product with the row-expanded scales): 0.24 ms for wq_b's 32768 × 1280 at 16K tokens on the H200.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv4cp.kernels._triton import TL_DTYPES, check_out_dtype, interpreting, to_dtype
from dsv4cp.ops.linear import WEIGHT_BLOCK, check_fp8_blocks
from dsv4cp.ops.quant import scale_to_float

CONFIG = (32, 128, 4)  # BLOCK_R, BLOCK_K, num_warps (benchmarks/fp8_dequant.py: §13)


@triton.jit
def _dequant_fp8_kernel(
    w_ptr,
    scale_ptr,
    out_ptr,
    N,
    K,
    stride_w,
    stride_s,
    stride_o,
    BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    EMULATE: tl.constexpr,
    E8M0: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rows < N)[:, None] & (cols < K)[None, :]
    r = rows[:, None]
    code = tl.load(w_ptr + r * stride_w + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr + (r // BLOCK) * stride_s + (cols // BLOCK)[None, :], mask=ok, other=0)
    if E8M0:  # the scale's byte b → 2^(b−127) as ops.quant.e8m0_to_float
        b = s.to(tl.int32)
        s = (b << 23).to(tl.float32, bitcast=True)
        s = tl.where(b == 0, 2.0**-127, s)
        s = tl.where(b == 255, float("nan"), s)
    tl.store(
        out_ptr + r * stride_o + cols[None, :], to_dtype(code * s, OUT_DTYPE, EMULATE), mask=ok
    )


def dequant_fp8_blocks(
    w: Tensor,
    scale: Tensor,
    block: int = WEIGHT_BLOCK,
    *,
    out_dtype: torch.dtype = torch.float32,
    config: tuple[int, int, int] | None = None,
    host_scales: bool = False,
) -> Tensor:
    """fp8 weight [N, K] with block scales [ceil(N/block), ceil(K/block)] → out_dtype [N, K]
    (exact in fp32 and bf16). `config` (BLOCK_R, BLOCK_K, num_warps) and `host_scales` (e8m0
    scales converted by torch first, as before) are for benchmarks and tests."""
    n, k = check_fp8_blocks(w, scale, block, "dequant_fp8_blocks")
    check_out_dtype(out_dtype, "dequant_fp8_blocks")
    w = w if w.stride(-1) == 1 else w.contiguous()
    e8m0 = scale.dtype in (torch.float8_e8m0fnu, torch.uint8) and not host_scales
    s = (scale.view(torch.uint8) if e8m0 else scale_to_float(scale)).contiguous()
    out = torch.empty(n, k, dtype=out_dtype, device=w.device)
    block_r, block_k, warps = config or CONFIG
    if any(v < 1 or v & (v - 1) for v in (block_r, block_k, warps)):
        raise ValueError(f"dequant_fp8_blocks: config {config} must be powers of two")
    if n and k:
        _dequant_fp8_kernel[(triton.cdiv(n, block_r), triton.cdiv(k, block_k))](
            w,
            s,
            out,
            n,
            k,
            w.stride(0),
            s.stride(0),
            out.stride(0),
            BLOCK=block,
            BLOCK_R=block_r,
            BLOCK_K=block_k,
            OUT_DTYPE=TL_DTYPES[out_dtype],
            EMULATE=interpreting(),
            E8M0=e8m0,
            num_warps=warps,
        )
    return out
