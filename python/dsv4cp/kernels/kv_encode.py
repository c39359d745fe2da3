"""Quantize a row tile in Triton registers and store it as the caches keep it (`ops.kv_format`):
codes first, then one scale byte per block, one uint8 row per key.

`quant_blocks` is the quantizers of `dsv4cp.ops.quant` bit for bit (the fake quant of
`kernels.fake_quant` multiplies its codes by its scales); `store_encoded` writes the codes'
bytes: e4m3 codes (`fp8_ue8m0_32`), or e2m1 codes packed two per byte, the even element in the
low nibble (`fp4_e4m3_16`, `fp4_ue8m0_32`), and the scales as ue8m0 (the fp32 exponent field)
or e4m3 bytes. The code's sign bit is the value's, -0.0 included, as torch's fp8 cast and
`ops.quant._e2m1_codes` (signbit) set it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4cp.kernels._triton import e4m3_rne, pow2_ceil
from dsv4cp.kernels.precise_math import div


@triton.jit
def e2m1_rne(v):
    """fp32 v with |v| ≤ 6 -> the nearest e2m1 value, ties to the even code (ops.quant.e2m1_round),
    sign kept: the grid step is 0.5 below 2, 1 below 4, 2 up to 6."""
    mag = tl.abs(v)
    step = tl.where(mag < 2.0, 0.5, tl.where(mag < 4.0, 1.0, 2.0))
    rounded = ((mag / step + 12582912.0) - 12582912.0) * step  # half to even, as e4m3_rne
    # the sign bit copied, not negated: -(+0.0) may compile to 0 - 0 = +0 on the GPU
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def quant_blocks(
    y,
    QUANT: tl.constexpr,
    QBLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISE: tl.constexpr,
):
    """y [BLOCK_T, BLOCK_D] quantized per QBLOCK columns, as dsv4cp.ops.quant: 1 = act_quant_fp8,
    2 = fp4_quant, 3 = fp4_quant_e4m3_scale (amax floors and fp32 reciprocals of the reference
    kernels). Returns (code values q [BLOCK_T, BLOCK_D // QBLOCK, QBLOCK], scales s
    [BLOCK_T, BLOCK_D // QBLOCK]): exact e4m3 / e2m1 values with y's sign, and fp32 scales."""
    yb = tl.reshape(y, (BLOCK_T, BLOCK_D // QBLOCK, QBLOCK))
    amax = tl.max(tl.abs(yb), axis=2)
    if QUANT == 1:
        s = pow2_ceil(tl.maximum(amax, 1e-4) * (1.0 / 448.0))
        v = tl.minimum(tl.maximum(div(yb, s[:, :, None], PRECISE), -448.0), 448.0)
        q = e4m3_rne(v)
    elif QUANT == 2:
        # floor just below 6·2^-126 (7.0530e-38): pow2_ceil maps every amax/6 ≤ 2^-126 to
        # 2^-126 either way, so the codes equal the twin's (`ops.quant`, floor 6·2^-126)
        s = pow2_ceil(tl.maximum(amax, 7.052316384526264e-38) * (1.0 / 6.0))
        v = tl.minimum(tl.maximum(div(yb, s[:, :, None], PRECISE), -6.0), 6.0)
        q = e2m1_rne(v)
    else:
        a = tl.maximum(amax, 0.01171875)  # floor 6·2^-9
        s = e4m3_rne(tl.minimum(div(a, 6.0, PRECISE), 448.0))
        v = tl.minimum(tl.maximum(div(yb, s[:, :, None], PRECISE), -6.0), 6.0)
        q = e2m1_rne(v)
    return q, s


@triton.jit
def e4m3_code(v):
    """An exact e4m3 value (fp32, |v| ≤ 448) -> its byte as int32: sign, 4 exponent bits (bias 7),
    3 mantissa bits; below 2^-6 the subnormals m · 2^-9."""
    bits = v.to(tl.int32, bitcast=True)
    mag = tl.abs(v)
    normal = ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 7)
    sub = (mag * 512.0).to(tl.int32)
    return tl.where(mag >= 0.015625, normal, sub) | ((bits >> 24) & 0x80)


@triton.jit
def e2m1_code(v):
    """An exact e2m1 value (fp32) -> its 4-bit code as int32 (bit 3 = sign, -0.0 -> 8)."""
    mag = tl.abs(v)
    index = tl.where(mag < 2.0, mag * 2.0, tl.where(mag < 4.0, mag + 2.0, mag * 0.5 + 4.0))
    return index.to(tl.int32) | ((v.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def store_encoded(
    row_ptrs,
    q,
    s,
    row_ok,
    D,
    QUANT: tl.constexpr,
    QBLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Store `quant_blocks`' (q, s) of BLOCK_T rows at row_ptrs [BLOCK_T] (uint8 rows of
    D / per-code + D / QBLOCK bytes), rows where row_ok; the first D columns are the row."""
    qf = tl.reshape(q, (BLOCK_T, BLOCK_D))
    if QUANT == 1:
        cols = tl.arange(0, BLOCK_D)
        tl.store(
            row_ptrs[:, None] + cols[None, :],
            e4m3_code(qf).to(tl.uint8),
            mask=row_ok[:, None] & (cols < D)[None, :],
        )
        n_code = D
        scale = (s.to(tl.int32, bitcast=True) >> 23) & 0xFF
    else:
        lo, hi = tl.split(tl.reshape(e2m1_code(qf), (BLOCK_T, BLOCK_D // 2, 2)))
        cols = tl.arange(0, BLOCK_D // 2)
        tl.store(
            row_ptrs[:, None] + cols[None, :],
            (lo | (hi << 4)).to(tl.uint8),
            mask=row_ok[:, None] & (cols < D // 2)[None, :],
        )
        n_code = D // 2
        if QUANT == 2:
            scale = (s.to(tl.int32, bitcast=True) >> 23) & 0xFF
        else:
            scale = e4m3_code(s)
    blocks = tl.arange(0, BLOCK_D // QBLOCK)
    tl.store(
        row_ptrs[:, None] + n_code + blocks[None, :],
        scale.to(tl.uint8),
        mask=row_ok[:, None] & (blocks < D // QBLOCK)[None, :],
    )
