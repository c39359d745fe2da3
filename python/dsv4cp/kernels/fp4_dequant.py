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

from dsv4cp.kernels._triton import TL_DTYPES, check_out_dtype, interpreting, to_dtype
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


@triton.jit
def _dequant_fp4_pairs_kernel(
    packed_ptr,
    scale_ptr,
    out_ptr,
    N,
    KB,
    stride_p,
    stride_s,
    stride_o,
    BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_B: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    EMULATE: tl.constexpr,
):
    # byte-wise: BLOCK_B packed bytes per row loaded once (contiguous), both nibbles decoded,
    # the block scales loaded once per BLOCK / 2 bytes and broadcast, the two halves interleaved
    # (even element = low nibble) and stored as 2·BLOCK_B contiguous values
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    r_ok = (rows < N)[:, None]
    r = rows[:, None]
    byte = tl.load(packed_ptr + r * stride_p + b[None, :], mask=r_ok & (b < KB)[None, :], other=0)
    byte = byte.to(tl.int32) & 0xFF
    NS: tl.constexpr = BLOCK_B * 2 // BLOCK
    sb = tl.program_id(1) * NS + tl.arange(0, NS)
    s = tl.load(scale_ptr + r * stride_s + sb[None, :], mask=r_ok & (sb < KB * 2 // BLOCK)[None, :])
    s = tl.reshape(tl.broadcast_to(s[:, :, None], [BLOCK_R, NS, BLOCK // 2]), [BLOCK_R, BLOCK_B])
    lo = _minifloat(byte & 0xF, 2, 1, 1) * s
    hi = _minifloat(byte >> 4, 2, 1, 1) * s
    val = tl.reshape(tl.join(lo, hi), [BLOCK_R, 2 * BLOCK_B])
    cols = tl.program_id(1) * (2 * BLOCK_B) + tl.arange(0, 2 * BLOCK_B)
    ok = r_ok & (cols < 2 * KB)[None, :]
    tl.store(out_ptr + r * stride_o + cols[None, :], to_dtype(val, OUT_DTYPE, EMULATE), mask=ok)


def _operands(
    packed: Tensor, scale: Tensor, block: int, out_dtype: torch.dtype
) -> tuple[int, int, Tensor, Tensor, Tensor]:
    """(N, K, the codes as uint8 rows, the scales in fp32, the empty output) after the checks."""
    n, k = check_fp4_weight(packed, scale, block)
    check_out_dtype(out_dtype, "dequant_fp4")
    codes = packed.view(torch.uint8)
    codes = codes if codes.stride(-1) == 1 else codes.contiguous()
    s = scale_to_float(scale).contiguous()
    return n, k, codes, s, torch.empty(n, k, dtype=out_dtype, device=packed.device)


# (rows, bytes per program, warps) of the byte-wise candidate; not on the MoE's path until
# benchmarks/fp4_dequant measures it against the element-wise kernel above
PAIRS_CONFIG = (4, 512, 4)


def dequant_fp4_pairs(
    packed: Tensor,
    scale: Tensor,
    block: int = WEIGHT_BLOCK,
    *,
    out_dtype: torch.dtype = torch.float32,
    config: tuple[int, int, int] = PAIRS_CONFIG,
) -> Tensor:
    """`dequant_fp4` by the byte-wise kernel (a candidate; the same values bit for bit)."""
    block_r, block_b, warps = config
    if block % 2 or block_b % (block // 2):
        raise ValueError(f"dequant_fp4_pairs: {block_b} bytes per program not whole blocks")
    n, k, codes, s, out = _operands(packed, scale, block, out_dtype)
    if n and k:
        _dequant_fp4_pairs_kernel[(triton.cdiv(n, block_r), triton.cdiv(k // 2, block_b))](
            codes, s, out, n, k // 2, codes.stride(0), s.stride(0), out.stride(0),
            BLOCK=block, BLOCK_R=block_r, BLOCK_B=block_b, OUT_DTYPE=TL_DTYPES[out_dtype],
            EMULATE=interpreting(), num_warps=warps,
        )  # fmt: skip
    return out


def dequant_fp4(
    packed: Tensor,
    scale: Tensor,
    block: int = WEIGHT_BLOCK,
    *,
    out_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Packed fp4 [N, K/2] (int8 / uint8 / float4_e2m1fn_x2) with scales [N, K/block] → out_dtype
    [N, K] (exact in fp32 and bf16)."""
    n, k, codes, s, out = _operands(packed, scale, block, out_dtype)
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
