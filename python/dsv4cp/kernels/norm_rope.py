"""Fused norm/RoPE row kernel: [pair pool] → [round] → RMSNorm → [round] → RoPE → [round →
fake quant, or quantize and encode] → store.

`norm_rope_rows` launches it for every twin that normalizes or rotates rows: the SWA key
(`kernels.swa`: norm + rope in fp32, cast once, scattered to the cache slots, attention-math
§4.3/§5.1), the RoPE-only passes (`kernels.rope`: the index queries, the q tail and its inverse)
and the compressor (§5.2, `kernels.compressor`: its pooling and rounding steps switched on).
Each program takes BLOCK_T rows of D (padded to a power of two)
and makes one pass: read the row(s) once, write the result once.

quant="qat" (docs/quantization.md): the norm and the RoPE output are rounded to the input's dtype
and the finished row is fake-quantized in blocks along D (`kernels.fake_quant`: the quantizers of
`dsv4cp.ops.quant` bit for bit). Blocks may
straddle the RoPE boundary (D − rope_dim need not be a multiple of the block), so in this mode
the row is rotated as one tile: each RoPE column also loads its pair partner. With `encode` the
row is stored as the cache keeps it (`kernels.kv_encode`: codes and scale bytes, the format of
`ops.kv_format`), at its slot: the SWA key, the compressed key and the index key go from
registers to their cache rows in the pass that computes them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv4cp.kernels._triton import TL_DTYPES, interpreting, to_dtype
from dsv4cp.kernels.fake_quant import ENCODED_FORMATS, FAKE_QUANTS, fake_quant_blocks
from dsv4cp.kernels.kv_encode import quant_blocks, store_encoded
from dsv4cp.kernels.precise_math import cos_sin, exp, rsqrt
from dsv4cp.ops.kv_format import row_width
from dsv4cp.ops.rope import YarnScaling, rope_inv_freq

MAX_D = 8192  # the hidden size (5120) fits: one row per program there
# (rows per program for a 512-wide row, num_warps) by padded row width; benchmarks/kernels.py
# (sections rows and rope) sweeps them. Narrow rows ran faster on the H200 with few warps of few
# rows (benchmarks/results/kernels_rope_h200_2026-12-03d.json, docs/performance.md §8): the q
# tail (64 wide) 1.02 → 0.226 ms with one warp of 8 rows, the index queries (128 wide, qat)
# 0.656 → 0.322 ms with two warps of 4 rows; with the pairs moved as whole vectors (§9) 0.107
# and 0.162 ms (kernels_rope_h200_2026-12-03e.json).
DEFAULT_CONFIG = (8, 4)
NARROW_CONFIGS = {64: (1, 1), 128: (1, 2)}


def default_config(block_d: int) -> tuple[int, int]:
    """(rows per 512 columns, num_warps) for rows padded to `block_d` columns."""
    return NARROW_CONFIGS.get(block_d, DEFAULT_CONFIG)


@triton.jit
def _pairwise_row_sums(v, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Each row's sum of v [BLOCK_T, BLOCK_D] (BLOCK_D a power of two) as a fixed tree: columns
    2j and 2j + 1 added, then the same on the halves. Each step is one commutative add, so the
    sum does not depend on the layout Triton gives v; a plain tl.sum's order does, and the dense
    and encoded variants of this kernel (different layouts, from their stores) then normalized
    some rows an ulp apart."""
    for i in tl.static_range(BLOCK_D.bit_length() - 1):
        v = tl.sum(tl.reshape(v, [BLOCK_T, BLOCK_D >> (i + 1), 2]), 2)
    return tl.reshape(v, [BLOCK_T])


@triton.jit
def _load_prep(
    x_ptr,
    g_ptr,
    px_ptr,
    pg_ptr,
    prow,
    rows64,
    xrows64,
    above64,
    cols,
    ok,
    stride_x,
    stride_g,
    stride_px,
    stride_pg,
    POOL: tl.constexpr,
    POOL_ROWS: tl.constexpr,
    ROUND_IN: tl.constexpr,
    DTYPE: tl.constexpr,
    PRECISE: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Load x at (rows, cols) as fp32, pair-pooled and rounded to DTYPE when asked. Row r's
    values are x's row xrows64 (r itself without a source map), the row above's above64 (−1:
    none); rows64 indexes the aligned partner rows of a pool without pool_rows."""
    x = tl.load(x_ptr + xrows64[:, None] * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if POOL:
        # Per-channel softmax over (partner = even token, this row = odd token).
        g1 = tl.load(g_ptr + xrows64[:, None] * stride_g + cols, mask=ok, other=0.0)
        if POOL_ROWS:
            # the partner is the pair state's row prow (>= 0), else the row above in x and g
            st = (prow >= 0)[:, None]
            above = above64
            a_ok = ok & ~st & (above >= 0)[:, None]
            prow64 = prow.to(tl.int64)[:, None]
            x0 = tl.where(
                st,
                tl.load(px_ptr + prow64 * stride_px + cols, mask=ok & st, other=0.0),
                tl.load(x_ptr + above[:, None] * stride_x + cols, mask=a_ok, other=0.0),
            )
            g0 = tl.where(
                st,
                tl.load(pg_ptr + prow64 * stride_pg + cols, mask=ok & st, other=0.0),
                tl.load(g_ptr + above[:, None] * stride_g + cols, mask=a_ok, other=0.0),
            )
        else:
            x0 = tl.load(px_ptr + rows64[:, None] * stride_px + cols, mask=ok, other=0.0)
            g0 = tl.load(pg_ptr + rows64[:, None] * stride_pg + cols, mask=ok, other=0.0)
        g0 = g0.to(tl.float32)
        g1 = g1.to(tl.float32)
        mx = tl.maximum(g0, g1)
        e0 = exp(g0 - mx, PRECISE)
        e1 = exp(g1 - mx, PRECISE)
        x = (e0 * x0.to(tl.float32) + e1 * x) / (e0 + e1)
    if ROUND_IN:
        x = to_dtype(x, DTYPE, EMULATE).to(tl.float32)
    return x


@triton.jit
def _load_normed(
    x_ptr,
    g_ptr,
    px_ptr,
    pg_ptr,
    w_ptr,
    prow,
    rows64,
    xrows64,
    above64,
    cols,
    ok,
    w_ok,
    inv,
    stride_x,
    stride_g,
    stride_px,
    stride_pg,
    POOL: tl.constexpr,
    POOL_ROWS: tl.constexpr,
    ROUND_IN: tl.constexpr,
    NORM: tl.constexpr,
    HAS_W: tl.constexpr,
    ROUND_MID: tl.constexpr,
    DTYPE: tl.constexpr,
    RDT: tl.constexpr,
    PRECISE: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """The row values at (rows, cols [1, N]) up to the mid rounding, with the row's 1/rms `inv`:
    loaded (pooled, rounded in), × inv, × the norm weight, rounded to RDT."""
    v = _load_prep(
        x_ptr,
        g_ptr,
        px_ptr,
        pg_ptr,
        prow,
        rows64,
        xrows64,
        above64,
        cols,
        ok,
        stride_x,
        stride_g,
        stride_px,
        stride_pg,
        POOL,
        POOL_ROWS,
        ROUND_IN,
        DTYPE,
        PRECISE,
        EMULATE,
    )
    if NORM:
        v = v * inv[:, None]
        if HAS_W:
            v = v * tl.load(w_ptr + cols, mask=w_ok, other=0.0).to(tl.float32)
    if ROUND_MID:
        v = to_dtype(v, RDT, EMULATE).to(tl.float32)
    return v


@triton.jit
def _norm_rope_kernel(
    x_ptr,
    g_ptr,
    px_ptr,
    pg_ptr,
    w_ptr,
    prow_ptr,
    src_ptr,
    freq_ptr,
    pos_ptr,
    slot_ptr,
    out_ptr,
    mid_ptr,
    T,
    D,
    ROPE0,
    eps,
    stride_x,
    stride_g,
    stride_px,
    stride_pg,
    stride_out,
    stride_mid,
    POOL: tl.constexpr,
    POOL_ROWS: tl.constexpr,
    SRC_ROWS: tl.constexpr,
    ROUND_IN: tl.constexpr,
    NORM: tl.constexpr,
    HAS_W: tl.constexpr,
    ROUND_MID: tl.constexpr,
    ROPE: tl.constexpr,
    INVERSE: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    WRITE_MID: tl.constexpr,
    QUANT: tl.constexpr,
    QBLOCK: tl.constexpr,
    ENCODE: tl.constexpr,
    RDT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISE: tl.constexpr,
    EMULATE: tl.constexpr,
):
    # The whole row is one tile (norm, the unrotated dims, mid). Without fake quant the rope
    # dims are read again as a contiguous tile of (even, odd) pairs so that cos/sin are
    # evaluated only for the rope_dim / 2 pairs; with it the row's own pairs are rotated.
    # ENCODE: out holds uint8 rows (codes, then scales); the values round to RDT
    dt = RDT if ENCODE else out_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    r_ok = rows < T
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    ok = r_ok[:, None] & (cols < D)[None, :]
    prow = rows
    if POOL_ROWS:
        prow = tl.load(prow_ptr + rows64, mask=r_ok, other=-1)
    if SRC_ROWS:  # row r's input is x's row src[r] (e.g. the all-gather's rank-major rows)
        xrows64 = tl.load(src_ptr + rows64, mask=r_ok, other=0).to(tl.int64)
        above64 = tl.load(src_ptr + rows64 - 1, mask=r_ok & (rows >= 1), other=-1).to(tl.int64)
    else:
        xrows64 = rows64
        above64 = rows64 - 1
    x_ok = ok
    if ROPE and QUANT == 0 and not NORM and not WRITE_MID:
        x_ok = ok & (cols < ROPE0)[None, :]  # the rope columns are read below, as pairs
    x = _load_prep(
        x_ptr,
        g_ptr,
        px_ptr,
        pg_ptr,
        prow,
        rows64,
        xrows64,
        above64,
        cols[None, :],
        x_ok,
        stride_x,
        stride_g,
        stride_px,
        stride_pg,
        POOL,
        POOL_ROWS,
        ROUND_IN,
        dt,
        PRECISE,
        EMULATE,
    )
    inv = tl.full([BLOCK_T], 1.0, tl.float32)
    if NORM:
        inv = rsqrt(_pairwise_row_sums(x * x, BLOCK_T, BLOCK_D) / D + eps, PRECISE)
        x = x * inv[:, None]
        if HAS_W:
            x = x * tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    if ROUND_MID:
        x = to_dtype(x, RDT, EMULATE).to(tl.float32)
    if WRITE_MID:
        tl.store(
            mid_ptr + rows64[:, None] * stride_mid + cols[None, :],
            to_dtype(x, mid_ptr.dtype.element_ty, EMULATE),
            mask=ok,
        )
    if HAS_SLOTS:
        # a negative slot stores nothing (a row that emits no entry)
        dst = tl.load(slot_ptr + rows, mask=r_ok, other=-1).to(tl.int64)
        st_ok = r_ok & (dst >= 0)
    else:
        dst = rows64
        st_ok = r_ok
    ok = st_ok[:, None] & (cols < D)[None, :]
    out_rows = out_ptr + dst[:, None] * stride_out
    if QUANT != 0:
        y = x
        if ROPE:
            # the row's (even, odd) column pairs split in registers (ROPE0 is even): pair j is
            # columns 2j, 2j + 1, a RoPE pair when 2j ≥ ROPE0, with frequency j − ROPE0 / 2
            xe, xo = tl.split(tl.reshape(x, [BLOCK_T, BLOCK_D // 2, 2]))
            j = tl.arange(0, BLOCK_D // 2)
            is_rope = (2 * j >= ROPE0) & (2 * j < D)
            freq = tl.load(freq_ptr + (j - ROPE0 // 2), mask=is_rope, other=0.0)
            pos = tl.load(pos_ptr + rows, mask=r_ok, other=0).to(tl.float32)
            cos, sin = cos_sin(pos[:, None] * freq[None, :], PRECISE)
            if INVERSE:
                sin = -sin
            re = to_dtype(xe * cos - xo * sin, RDT, EMULATE).to(tl.float32)
            ro = to_dtype(xe * sin + xo * cos, RDT, EMULATE).to(tl.float32)
            re = tl.where(is_rope[None, :], re, xe)
            ro = tl.where(is_rope[None, :], ro, xo)
            y = tl.reshape(tl.join(re, ro), [BLOCK_T, BLOCK_D])
        if ENCODE:
            q, s = quant_blocks(y, QUANT, QBLOCK, BLOCK_T, BLOCK_D, PRECISE)
            dst_rows = out_ptr + dst * stride_out
            store_encoded(dst_rows, q, s, st_ok, D, QUANT, QBLOCK, BLOCK_T, BLOCK_D)
        else:
            y = fake_quant_blocks(y, QUANT, QBLOCK, BLOCK_T, BLOCK_D, PRECISE)
            tl.store(out_rows + cols[None, :], to_dtype(y, dt, EMULATE), mask=ok)
    elif ROPE:
        tl.store(
            out_rows + cols[None, :],
            to_dtype(x, dt, EMULATE),
            mask=st_ok[:, None] & (cols < ROPE0)[None, :],
        )
        # the RoPE columns as one contiguous tile of BLOCK_R (even, odd) pairs, split in
        # registers: whole-vector loads and stores, no strided pair accesses
        rc = ROPE0 + tl.arange(0, 2 * BLOCK_R)
        rc_ok = rc < D
        v = _load_normed(
            x_ptr,
            g_ptr,
            px_ptr,
            pg_ptr,
            w_ptr,
            prow,
            rows64,
            xrows64,
            above64,
            rc[None, :],
            r_ok[:, None] & rc_ok[None, :],
            rc_ok[None, :],
            inv,
            stride_x,
            stride_g,
            stride_px,
            stride_pg,
            POOL,
            POOL_ROWS,
            ROUND_IN,
            NORM,
            HAS_W,
            ROUND_MID,
            dt,
            RDT,
            PRECISE,
            EMULATE,
        )
        a, b = tl.split(tl.reshape(v, [BLOCK_T, BLOCK_R, 2]))
        pair = tl.arange(0, BLOCK_R)
        freq = tl.load(freq_ptr + pair, mask=pair < (D - ROPE0) // 2, other=0.0)
        pos = tl.load(pos_ptr + rows, mask=r_ok, other=0).to(tl.float32)
        cos, sin = cos_sin(pos[:, None] * freq[None, :], PRECISE)
        if INVERSE:
            sin = -sin
        rot = tl.reshape(tl.join(a * cos - b * sin, a * sin + b * cos), [BLOCK_T, 2 * BLOCK_R])
        tl.store(
            out_rows + rc[None, :], to_dtype(rot, dt, EMULATE), mask=st_ok[:, None] & rc_ok[None, :]
        )
    else:
        tl.store(out_rows + cols[None, :], to_dtype(x, dt, EMULATE), mask=ok)


@functools.lru_cache(maxsize=64)
def _inv_freq(rope_dim: int, theta: float, yarn: YarnScaling | None, device: str) -> Tensor:
    return rope_inv_freq(rope_dim, theta, yarn, device=device)


def inv_freq(rope_dim: int, theta: float, yarn: YarnScaling | None, device: torch.device) -> Tensor:
    """ω_i [rope_dim // 2] fp32 on `device`, cached per (rope_dim, theta, yarn, device)."""
    return _inv_freq(rope_dim, float(theta), yarn, str(device))


def _rows(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def norm_rope_rows(
    x: Tensor,
    out: Tensor,
    *,
    positions: Tensor | None,
    rope_dim: int,
    theta: float,
    yarn: YarnScaling | None,
    norm_weight: Tensor | None = None,
    eps: float = 0.0,
    norm: bool = True,
    slots: Tensor | None = None,
    pool: tuple[Tensor, Tensor, Tensor] | None = None,
    pool_rows: Tensor | None = None,
    src_rows: Tensor | None = None,
    round_in: bool = False,
    round_mid: bool = False,
    mid: Tensor | None = None,
    inverse: bool = False,
    fake_quant: str | None = None,
    encode: bool = False,
    round_dtype: torch.dtype | None = None,
    config: tuple[int, int] | None = None,
) -> None:
    """Launch the fused row kernel. See the module doc. round_in rounds to out.dtype; round_mid
    and, with `fake_quant` (a key of FAKE_QUANTS), the RoPE output round to `round_dtype`
    (default out.dtype) before the row is fake-quantized.

    encode: store the quantizer's codes and scales instead (out: uint8 rows of the cache format
    ENCODED_FORMATS[fake_quant]; round_in and the roundings then use round_dtype, required).
    pool_rows: with `pool = (gate, state_kv, state_gate)`, row t's partner is the state's row
    pool_rows[t] when that is >= 0, else row t − 1 of x and gate. src_rows [T]: row t's input
    is row src_rows[t] of x (and gate; the row above t's is src_rows[t − 1]): x may be the CP
    all-gather's rank-major rows, read in token order through `CPLayout.rerange_index` without
    a rerange copy. slots: a negative slot stores nothing (mid is written for every row)."""
    if x.dim() != 2:
        raise ValueError(f"norm/rope kernel: rows must be [T, D], got {tuple(x.shape)}")
    t, d = x.shape
    if src_rows is not None:
        if src_rows.dim() != 1 or (pool is not None and pool_rows is None):
            raise ValueError("norm/rope kernel: src_rows must be [T], with pool_rows if pooled")
        t = src_rows.shape[0]  # the rows of the launch; x holds at least the rows they name
    if d > MAX_D:
        raise ValueError(f"norm/rope kernel: D must be at most {MAX_D}, got {d}")
    if rope_dim % 2 or d % 2 or rope_dim > d or (positions is None and rope_dim):
        raise ValueError(f"norm/rope kernel: rope_dim {rope_dim} must be even and <= D = {d}")
    width = d
    if encode:
        if fake_quant is None or round_dtype is None:
            raise ValueError("norm/rope kernel: encode needs fake_quant and round_dtype")
        width = row_width(ENCODED_FORMATS[fake_quant], d)
        if out.dtype != torch.uint8:
            raise ValueError(f"norm/rope kernel: encoded rows are uint8, got {out.dtype}")
    if out.dim() != 2 or out.shape[1] != width:
        raise ValueError(f"norm/rope kernel: out must be [*, {width}], got {tuple(out.shape)}")
    if t == 0:
        return
    if slots is not None and slots.shape != (t,):
        raise ValueError(f"norm/rope kernel: slots must be [{t}], got {tuple(slots.shape)}")
    if positions is not None and positions.shape != (t,):
        raise ValueError(f"norm/rope kernel: positions must be [{t}], got {tuple(positions.shape)}")
    if norm_weight is not None and norm_weight.shape != (d,):
        raise ValueError(f"norm/rope kernel: weight must be [{d}], got {tuple(norm_weight.shape)}")
    if out.stride(1) != 1 or (mid is not None and mid.stride(1) != 1):
        raise ValueError("norm/rope kernel: out and mid need unit stride along D")
    quant, qblock = FAKE_QUANTS[fake_quant] if fake_quant is not None else (0, 16)
    if fake_quant is not None and d % qblock:
        raise ValueError(f"norm/rope kernel: D = {d} is not a multiple of the {qblock} block")
    rdt = round_dtype or out.dtype
    if rdt not in TL_DTYPES:
        raise ValueError(f"norm/rope kernel: cannot round to {rdt}")
    x = _rows(x)
    g, px, pg = (_rows(p) for p in pool) if pool is not None else (x, x, x)
    if pool_rows is not None:
        if pool is None or pool_rows.shape != (t,):
            raise ValueError(f"norm/rope kernel: pool_rows must be [{t}] and come with a pool")
        if g.shape != x.shape or px.shape[1:] != x.shape[1:] or pg.shape != px.shape:
            raise ValueError(f"pair_pool kernel: gate {tuple(x.shape)}, state [*, {d}] expected")
    else:
        for p in (g, px, pg):
            if p.shape != x.shape:
                raise ValueError(f"pair_pool kernel: all four inputs must be {tuple(x.shape)}")
    rope = rope_dim > 0
    freq = inv_freq(rope_dim, theta, yarn, x.device) if rope else x
    block_d = max(16, triton.next_power_of_2(d))
    rows, warps = config or default_config(block_d)
    block_t = max(1, rows * 512 // block_d)
    _norm_rope_kernel[(triton.cdiv(t, block_t),)](
        x,
        g,
        px,
        pg,
        x if norm_weight is None else norm_weight.contiguous(),
        x if pool_rows is None else pool_rows.contiguous(),
        x if src_rows is None else src_rows.contiguous(),
        freq,
        x if positions is None else positions.contiguous(),
        x if slots is None else slots.contiguous(),
        out,
        out if mid is None else mid,
        t,
        d,
        d - rope_dim,
        float(eps),
        x.stride(0),
        g.stride(0),
        px.stride(0),
        pg.stride(0),
        out.stride(0),
        out.stride(0) if mid is None else mid.stride(0),
        POOL=pool is not None,
        POOL_ROWS=pool_rows is not None,
        SRC_ROWS=src_rows is not None,
        ROUND_IN=round_in,
        NORM=norm,
        HAS_W=norm_weight is not None,
        ROUND_MID=round_mid,
        ROPE=rope,
        INVERSE=inverse,
        HAS_SLOTS=slots is not None,
        WRITE_MID=mid is not None,
        QUANT=quant,
        QBLOCK=qblock,
        ENCODE=encode,
        RDT=TL_DTYPES[rdt],
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        BLOCK_R=max(16, triton.next_power_of_2(max(1, rope_dim // 2))),
        PRECISE=not interpreting(),
        EMULATE=interpreting(),
        num_warps=warps,
    )
