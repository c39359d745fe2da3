"""Packed fp4 weights (the routed experts' storage) dequantized in one Triton pass.

Twin: `dsv4cp.ops.linear.dequant_fp4` (same signature). Each program reads BLOCK_K packed
columns' bytes of BLOCK_R rows (two e2m1 codes per byte, the even element in the low nibble) and
their per-`block` scales (converted to fp32 on the host: e8m0 has values fp32 only reaches as
subnormals), and writes code × scale in out_dtype. Every e2m1 value times a power of two is
exact in fp32 and in bf16, so the result equals the twin's bit for bit (for scales ≥ 2⁻¹²⁴;
smaller ones give subnormal outputs, which the conversion may flush to zero). The torch twin makes
about ten fp32 passes over the weight (unpack, stack, flatten, scale expansion, product,
cast); this kernel reads half a byte and writes the output once per element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv4cp.kernels._triton import TL_DTYPES, interpreting, to_dtype
from dsv4cp.kernels.kv_decode import _minifloat
from dsv4cp.ops.linear import WEIGHT_BLOCK, check_fp4_weight
from dsv4cp.ops.quant import scale_to_float

# a 1K-wide piece of four rows per program: at the MoE's launch (32 experts × 2304 rows × 5120)
# benchmarks/fp4_dequant measured 0.566 ms per launch on the H200, 1.085x the previous one row
# (0.614 ms); 8 rows × 1K with 8 warps took 0.964 ms (benchmarks/results/fp4_dequant_h200_
# 2026-12-03d.json)
_BLOCK_R, _BLOCK_K, _WARPS = 4, 1024, 4


@triton.jit
def _dequant_fp4_kernel(
    packed_ptr,
    scale_ptr,
    out_ptr,
    N,
    K,
    stride_p,
    stride_s,
    stride_o,
    BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    EMULATE: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rows < N)[:, None] & (cols < K)[None, :]
    r = rows[:, None]
    byte = tl.load(packed_ptr + r * stride_p + (cols // 2)[None, :], mask=ok, other=0)
    byte = byte.to(tl.int32) & 0xFF
    code = tl.where((cols % 2 == 0)[None, :], byte & 0xF, byte >> 4)
    s = tl.load(scale_ptr + r * stride_s + (cols // BLOCK)[None, :], mask=ok, other=0.0)
    val = _minifloat(code, 2, 1, 1) * s
    dst = out_ptr + r * stride_o + cols[None, :]
    tl.store(dst, to_dtype(val, OUT_DTYPE, EMULATE), mask=ok)


def dequant_fp4(
    packed: Tensor,
    scale: Tensor,
    block: int = WEIGHT_BLOCK,
    *,
    out_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Packed fp4 [N, K/2] (int8 / uint8 / float4_e2m1fn_x2) with scales [N, K/block] → out_dtype
    [N, K] (exact in fp32 and bf16)."""
    n, k = check_fp4_weight(packed, scale, block)
    if out_dtype not in TL_DTYPES:
        raise ValueError(f"dequant_fp4: out_dtype must be fp32, bf16 or fp16, got {out_dtype}")
    codes = packed.view(torch.uint8)
    codes = codes if codes.stride(-1) == 1 else codes.contiguous()
    s = scale_to_float(scale).contiguous()
    out = torch.empty(n, k, dtype=out_dtype, device=packed.device)
    if n and k:
        tl_dtype = TL_DTYPES[out_dtype]
        _dequant_fp4_kernel[(triton.cdiv(n, _BLOCK_R), triton.cdiv(k, _BLOCK_K))](
            codes,
            s,
            out,
            n,
            k,
            codes.stride(0),
            s.stride(0),
            out.stride(0),
            BLOCK=block,
            BLOCK_R=_BLOCK_R,
            BLOCK_K=_BLOCK_K,
            OUT_DTYPE=tl_dtype,
            EMULATE=interpreting(),
            num_warps=_WARPS,
        )
    return out
