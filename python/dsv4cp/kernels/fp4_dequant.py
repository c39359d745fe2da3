"""Packed fp4 weights (the routed experts' storage) dequantized in one Triton pass.

Twin: `dsv4cp.ops.linear.dequant_fp4` (same signature). Each program reads BLOCK_B packed
bytes of BLOCK_R rows (two e2m1 codes per byte, the even element in the low nibble) and
their per-`block` scales (e8m0 bytes decoded in the kernel as `ops.quant.e8m0_to_float` does,
2^(bits-127), 0 → the subnormal 2^-127, 0xFF → NaN; float scales converted to fp32 on the host),
and writes code × scale in out_dtype. Every e2m1 value times a power of two is
exact in fp32 and in bf16, so the result equals the twin's bit for bit (for scales ≥ 2⁻¹²⁴;
smaller ones give subnormal outputs, which the conversion may flush to zero). The torch twin makes
about ten fp32 passes over the weight (unpack, stack, flatten, scale expansion, product,
cast); this kernel loads each packed byte once (16-byte vector loads), decodes both nibbles,
broadcasts the block scale over its bytes and interleaves the halves into 16-byte stores.
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


@triton.jit
def _dequant_fp4_kernel(
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
    E8M0: tl.constexpr,
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
    if E8M0:
        bits = s.to(tl.int32) & 0xFF
        s = (bits << 23).to(tl.float32, bitcast=True)
        s = tl.where(
            bits == 0, tl.full(bits.shape, 0x00400000, tl.int32).to(tl.float32, bitcast=True), s
        )
        s = tl.where(bits == 255, float("nan"), s)
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
    """(N, K, the codes as uint8 rows, the scales as e8m0 bytes (uint8) or fp32, the empty
    output) after the checks."""
    n, k = check_fp4_weight(packed, scale, block)
    check_out_dtype(out_dtype, "dequant_fp4")
    codes = packed.view(torch.uint8)
    codes = codes if codes.stride(-1) == 1 else codes.contiguous()
    e8m0 = scale.dtype in (torch.float8_e8m0fnu, torch.uint8)
    s = (scale.view(torch.uint8) if e8m0 else scale_to_float(scale)).contiguous()
    return n, k, codes, s, torch.empty(n, k, dtype=out_dtype, device=packed.device)


# (rows, packed bytes, warps) per program. At the MoE's launch (32 experts × 2304 rows × 5120 →
# bf16, e8m0 scales) benchmarks/fp4_dequant measured 0.411 ms on the H200 (2.41 TB/s), against
# 0.566 ms for the element-wise kernel it replaced (one single-byte load per output element);
# benchmarks/results/fp4_dequant_h200_2026-12-03e{,3}.json, docs/performance.md §9
CONFIG = (4, 512, 4)


def launch_dequant_fp4(
    packed: Tensor,
    scale: Tensor,
    block: int = WEIGHT_BLOCK,
    *,
    out_dtype: torch.dtype = torch.float32,
    config: tuple[int, int, int] = CONFIG,
) -> Tensor:
    """`dequant_fp4` with the tile `config` (rows, packed bytes, warps per program) for benchmarks
    and tests; the bytes must cover whole scale blocks."""
    block_r, block_b, warps = config
    if block % 2 or block_b % (block // 2):
        raise ValueError(f"dequant_fp4: {block_b} bytes per program not whole blocks")
    n, k, codes, s, out = _operands(packed, scale, block, out_dtype)
    if n and k:
        _dequant_fp4_kernel[(triton.cdiv(n, block_r), triton.cdiv(k // 2, block_b))](
            codes, s, out, n, k // 2, codes.stride(0), s.stride(0), out.stride(0),
            BLOCK=block, BLOCK_R=block_r, BLOCK_B=block_b, OUT_DTYPE=TL_DTYPES[out_dtype],
            EMULATE=interpreting(), E8M0=s.dtype == torch.uint8, num_warps=warps,
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
    return launch_dequant_fp4(packed, scale, block, out_dtype=out_dtype)
