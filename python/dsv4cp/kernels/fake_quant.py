"""Fake quantization of a row tile in Triton registers: quantize then dequantize per block along
D with the quantizers of `dsv4cp.ops.quant` done bit for bit (fp8 e4m3 / ue8m0 per 32 for the SWA
key, fp4 e2m1 / ue8m0 per 32 for index queries and keys, fp4 e2m1 / e4m3 per 16 for the
compressed key). The norm/RoPE row kernel (`kernels.norm_rope`) applies it under quant="qat"."""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4cp.kernels._triton import e4m3_rne, pow2_ceil
from dsv4cp.kernels.precise_math import div
from dsv4cp.ops.attention_quant import COMPRESSED_KEY_BLOCK, INDEX_BLOCK, SWA_KEY_BLOCK

# fake_quant name -> (QUANT code of `fake_quant_blocks`, block along D)
FAKE_QUANTS = {
    "fp8": (1, SWA_KEY_BLOCK),
    "fp4": (2, INDEX_BLOCK),
    "fp4_e4m3": (3, COMPRESSED_KEY_BLOCK),
}


@triton.jit
def e2m1_rne(v):
    """fp32 v with |v| ≤ 6 -> the nearest e2m1 value, ties to the even code (ops.quant.e2m1_round),
    sign kept: the grid step is 0.5 below 2, 1 below 4, 2 up to 6."""
    mag = tl.abs(v)
    step = tl.where(mag < 2.0, 0.5, tl.where(mag < 4.0, 1.0, 2.0))
    rounded = ((mag / step + 12582912.0) - 12582912.0) * step  # half to even, as e4m3_rne
    return tl.where(v.to(tl.int32, bitcast=True) < 0, -rounded, rounded)


@triton.jit
def fake_quant_blocks(
    y,
    QUANT: tl.constexpr,
    QBLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISE: tl.constexpr,
):
    """Quantize then dequantize y [BLOCK_T, BLOCK_D] per QBLOCK columns, as dsv4cp.ops.quant:
    1 = fake_act_quant_fp8, 2 = fake_fp4_quant, 3 = fake_fp4_quant_e4m3_scale (amax floors and
    fp32 reciprocals of the reference kernels)."""
    yb = tl.reshape(y, (BLOCK_T, BLOCK_D // QBLOCK, QBLOCK))
    amax = tl.max(tl.abs(yb), axis=2)
    if QUANT == 1:
        s = pow2_ceil(tl.maximum(amax, 1e-4) * (1.0 / 448.0))
        v = tl.minimum(tl.maximum(div(yb, s[:, :, None], PRECISE), -448.0), 448.0)
        q = e4m3_rne(v)
    elif QUANT == 2:
        s = pow2_ceil(tl.maximum(amax, 7.052316384526264e-38) * (1.0 / 6.0))  # floor 6·2^-126
        v = tl.minimum(tl.maximum(div(yb, s[:, :, None], PRECISE), -6.0), 6.0)
        q = e2m1_rne(v)
    else:
        a = tl.maximum(amax, 0.01171875)  # floor 6·2^-9
        s = e4m3_rne(tl.minimum(div(a, 6.0, PRECISE), 448.0))
        v = tl.minimum(tl.maximum(div(yb, s[:, :, None], PRECISE), -6.0), 6.0)
        q = e2m1_rne(v)
    return tl.reshape(q * s[:, :, None], (BLOCK_T, BLOCK_D))
