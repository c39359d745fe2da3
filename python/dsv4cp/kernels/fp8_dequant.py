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
SCALE_TILE = False  # scales loaded per element (from L1) or per block and broadcast
STREAM = False  # streaming cache hints on the weight's load and the copy's store


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
    SCALE_TILE: tl.constexpr,
    STREAM: tl.constexpr,
):
    if SCALE_TILE:  # 4-D tiles [row block, row, column block, column]: scales broadcast
        SR: tl.constexpr = BLOCK_R // BLOCK
        SK: tl.constexpr = BLOCK_K // BLOCK
        sr = tl.program_id(0).to(tl.int64) * SR + tl.arange(0, SR)
        sk = tl.program_id(1) * SK + tl.arange(0, SK)
        within = tl.arange(0, BLOCK)
        r = (sr[:, None] * BLOCK + within[None, :])[:, :, None, None]
        c = (sk[:, None] * BLOCK + within[None, :])[None, None, :, :]
        ok = (r < N) & (c < K)
        s_ok = (sr < tl.cdiv(N, BLOCK))[:, None] & (sk < tl.cdiv(K, BLOCK))[None, :]
        s = tl.load(scale_ptr + sr[:, None] * stride_s + sk[None, :], mask=s_ok, other=0)
        s = _decode_scale(s, E8M0)[:, None, :, None]
    else:
        r = (tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None]
        c = (tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K))[None, :]
        ok = (r < N) & (c < K)
        s = tl.load(scale_ptr + (r // BLOCK) * stride_s + c // BLOCK, mask=ok, other=0)
        s = _decode_scale(s, E8M0)
    if STREAM:  # the weight is read once and the copy written once: keep neither in L2
        code = tl.load(w_ptr + r * stride_w + c, mask=ok, other=0.0, eviction_policy="evict_first")
    else:
        code = tl.load(w_ptr + r * stride_w + c, mask=ok, other=0.0)
    y = to_dtype(code.to(tl.float32) * s, OUT_DTYPE, EMULATE)
    if STREAM:
        tl.store(out_ptr + r * stride_o + c, y, mask=ok, cache_modifier=".cs")
    else:
        tl.store(out_ptr + r * stride_o + c, y, mask=ok)


@triton.jit
def _decode_scale(s, E8M0: tl.constexpr):
    """Scales as fp32: an e8m0 byte b → 2^(b−127) as ops.quant.e8m0_to_float (0 → 2^−127, 255
    → NaN); fp32 scales as they are."""
    if E8M0:
        b = s.to(tl.int32)
        s = (b << 23).to(tl.float32, bitcast=True)
        s = tl.where(b == 0, 2.0**-127, s)
        s = tl.where(b == 255, float("nan"), s)
    return s


def dequant_fp8_blocks(
    w: Tensor,
    scale: Tensor,
    block: int = WEIGHT_BLOCK,
    *,
    out_dtype: torch.dtype = torch.float32,
    config: tuple[int, int, int] | None = None,
    host_scales: bool = False,
    scale_tile: bool | None = None,
    stream: bool | None = None,
) -> Tensor:
    """fp8 weight [N, K] with block scales [ceil(N/block), ceil(K/block)] → out_dtype [N, K]
    (exact in fp32 and bf16). `config` (BLOCK_R, BLOCK_K, num_warps), `host_scales` (e8m0
    scales converted by torch first, as before), `scale_tile` (one scale load per block,
    broadcast; needs BLOCK_R and BLOCK_K multiples of `block`) and `stream` (streaming cache
    hints) are for benchmarks and tests."""
    n, k = check_fp8_blocks(w, scale, block, "dequant_fp8_blocks")
    check_out_dtype(out_dtype, "dequant_fp8_blocks")
    w = w if w.stride(-1) == 1 else w.contiguous()
    e8m0 = scale.dtype in (torch.float8_e8m0fnu, torch.uint8) and not host_scales
    s = (scale.view(torch.uint8) if e8m0 else scale_to_float(scale)).contiguous()
    out = torch.empty(n, k, dtype=out_dtype, device=w.device)
    block_r, block_k, warps = config or CONFIG
    scale_tile = SCALE_TILE if scale_tile is None else scale_tile
    stream = STREAM if stream is None else stream
    if any(v < 1 or v & (v - 1) for v in (block_r, block_k, warps)):
        raise ValueError(f"dequant_fp8_blocks: config {config} must be powers of two")
    if scale_tile and (block_r % block or block_k % block):
        raise ValueError(
            f"dequant_fp8_blocks: scale_tile needs tile rows and columns ({block_r}, {block_k})"
            f" that are multiples of the block ({block})"
        )
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
            SCALE_TILE=scale_tile,
            STREAM=stream and not interpreting(),
            num_warps=warps,
        )
    return out
