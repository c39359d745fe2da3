"""Fake quantization of a row tile in Triton registers: quantize then dequantize per block along
D with the quantizers of `dsv4cp.ops.quant` done bit for bit (fp8 e4m3 / ue8m0 per 32 for the SWA
key, fp4 e2m1 / ue8m0 per 32 for index queries and keys, fp4 e2m1 / e4m3 per 16 for the
compressed key). The norm/RoPE row kernel (`kernels.norm_rope`) applies it under quant="qat";
`kernels.kv_encode` holds the quantizers and stores their codes instead."""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4cp.kernels.kv_encode import quant_blocks
from dsv4cp.ops.attention_quant import COMPRESSED_KEY_BLOCK, INDEX_BLOCK, SWA_KEY_BLOCK

# fake_quant name -> (QUANT code of `fake_quant_blocks`, block along D)
FAKE_QUANTS = {
    "fp8": (1, SWA_KEY_BLOCK),
    "fp4": (2, INDEX_BLOCK),
    "fp4_e4m3": (3, COMPRESSED_KEY_BLOCK),
}
# the cache format (`ops.kv_format`) that stores each fake quant's codes
ENCODED_FORMATS = {"fp8": "fp8_ue8m0_32", "fp4": "fp4_ue8m0_32", "fp4_e4m3": "fp4_e4m3_16"}


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
    1 = fake_act_quant_fp8, 2 = fake_fp4_quant, 3 = fake_fp4_quant_e4m3_scale."""
    q, s = quant_blocks(y, QUANT, QBLOCK, BLOCK_T, BLOCK_D, PRECISE)
    return tl.reshape(q * s[:, :, None], (BLOCK_T, BLOCK_D))
