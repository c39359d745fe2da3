"""Reading cache rows in their storage format inside a Triton kernel (`ops.kv_format`).

`load_key_rows` loads [BLOCK_N, D_PAD] key values from rows given as pointers: dense rows as
stored, quantized rows decoded from their code and scale bytes to exact fp32 values (every e4m3
or e2m1 code times its scale is exact in fp32, and in bf16). Used by the sparse attention and
the cached index logits; the host passes the format as `FORMAT_CODES[fmt]`. `decode_gather`
fills a bounded dense workspace from chosen rows (FlashMLA's input, the fused indexer's keys).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv4cp.kernels._triton import interpreting, to_dtype
from dsv4cp.ops.kv_format import check_format, row_width

# format codes the kernels branch on (constexpr)
FORMAT_CODES = {"dense": 0, "fp8_ue8m0_32": 1, "fp4_e4m3_16": 2, "fp4_ue8m0_32": 3}


@triton.jit
def _pow2(e):
    """2^e as fp32 for int32 e in [-126, 127], built from the exponent bits (exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _minifloat(b, EXP: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr):
    """Sign / EXP exponent bits / MAN mantissa bits (int32) → exact fp32 value: normal
    (2^MAN + m)·2^(e − BIAS − MAN), subnormal m·2^(1 − BIAS − MAN). e4m3: (4, 3, 7) (its NaN
    code never occurs: the quantizers saturate); e2m1: (2, 1, 1)."""
    e = (b >> MAN) & ((1 << EXP) - 1)
    m = b & ((1 << MAN) - 1)
    mag = tl.where(e == 0, m, m + (1 << MAN)).to(tl.float32)
    mag = mag * _pow2(tl.maximum(e, 1) - BIAS - MAN)
    return tl.where(((b >> (EXP + MAN)) & 1) == 1, -mag, mag)


@triton.jit
def _ue8m0_value(b):
    """ue8m0 byte → 2^(b−127) (b = 0: the subnormal 2^−127)."""
    return tl.where(b == 0, 5.877471754111438e-39, (b << 23).to(tl.float32, bitcast=True))


@triton.jit
def load_key_rows(row_ptr, d, mask, D: tl.constexpr, FMT: tl.constexpr):
    """Key values [BLOCK_N, D_PAD] of the rows at row_ptr [BLOCK_N, 1]: dense as stored, a
    quantized format decoded to fp32 (masked lanes are 0)."""
    if FMT == 0:
        vals = tl.load(row_ptr + d[None, :], mask=mask, other=0.0)
    elif FMT == 1:  # fp8 e4m3 codes [D], then one ue8m0 byte per 32
        b = tl.load(row_ptr + d[None, :], mask=mask, other=0).to(tl.int32)
        s = tl.load(row_ptr + D + d[None, :] // 32, mask=mask, other=127).to(tl.int32)
        vals = _minifloat(b, 4, 3, 7) * _ue8m0_value(s)
    else:  # packed e2m1 [D/2] (even element low), then e4m3 per 16 or ue8m0 per 32
        byte = tl.load(row_ptr + d[None, :] // 2, mask=mask, other=0).to(tl.int32)
        code = (byte >> ((d[None, :] & 1) * 4)) & 0xF
        if FMT == 2:
            s = tl.load(row_ptr + D // 2 + d[None, :] // 16, mask=mask, other=0).to(tl.int32)
            vals = _minifloat(code, 2, 1, 1) * _minifloat(s, 4, 3, 7)
        else:
            s = tl.load(row_ptr + D // 2 + d[None, :] // 32, mask=mask, other=127).to(tl.int32)
            vals = _minifloat(code, 2, 1, 1) * _ue8m0_value(s)
    return vals


@triton.jit
def _decode_gather_kernel(
    cache_ptr,
    src_ptr,
    out_ptr,
    ROWS,
    stride_c,
    stride_o,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    FMT: tl.constexpr,
    RNE: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < ROWS
    src = tl.load(src_ptr + r, mask=r_ok, other=-1)
    ok = r_ok & (src >= 0)
    d = tl.arange(0, D_PAD)
    mask = ok[:, None] & (d < D)[None, :]
    vals = load_key_rows(cache_ptr + src[:, None].to(tl.int64) * stride_c, d, mask, D, FMT)
    out = out_ptr + r[:, None].to(tl.int64) * stride_o + d[None, :]
    tl.store(out, to_dtype(vals.to(tl.float32), out_ptr.dtype.element_ty, RNE), mask=mask)


def decode_gather(
    cache: Tensor, src_rows: Tensor, fmt: str, dim: int, out: Tensor, *, block_r: int = 16
) -> Tensor:
    """out[i] = the key values of cache row src_rows[i] (decoded from `fmt`) in out.dtype, for
    every src_rows[i] ≥ 0; rows with −1 are left as they are. A bounded workspace's fill: the
    values are exact in bf16, so a bf16 workspace holds the dequantized keys bit for bit."""
    width = row_width(check_format(fmt), dim)
    if cache.dim() != 2 or cache.shape[1] != width:
        raise ValueError(f"decode_gather: cache must be [N, {width}] ({fmt}), got {cache.shape}")
    if src_rows.dim() != 1 or out.dim() != 2 or out.shape[1] != dim:
        raise ValueError(
            f"decode_gather: src_rows [B] and out [B, {dim}], got {tuple(src_rows.shape)}, "
            f"{tuple(out.shape)}"
        )
    if out.shape[0] < src_rows.shape[0] or out.stride(1) != 1:
        raise ValueError("decode_gather: out must hold every row, rows contiguous")
    rows = src_rows.shape[0]
    if rows == 0:
        return out
    if cache.stride(1) != 1:
        cache = cache.contiguous()
    src = src_rows if src_rows.dtype == torch.int32 else src_rows.to(torch.int32)
    _decode_gather_kernel[(triton.cdiv(rows, block_r),)](
        cache,
        src.contiguous(),
        out,
        rows,
        cache.stride(0),
        out.stride(0),
        D=dim,
        D_PAD=max(16, triton.next_power_of_2(dim)),
        BLOCK_R=block_r,
        FMT=FORMAT_CODES[fmt],
        RNE=interpreting(),
        num_warps=4,
    )
    return out
