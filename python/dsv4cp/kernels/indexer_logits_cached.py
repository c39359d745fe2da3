"""Indexer MQA logits read straight from an index-key cache (attention-math §5.3, §7):
logits[t, j] = Σ_h w[t,h]·relu(q[t,h]·k_j) with k_j the cache row k_rows[k_start[t] + j],
decoded on load from its storage format (`kernels.kv_decode`; fp4 + ue8m0 at 68 B per entry in
qat), so no dense index-K workspace is built.

One program owns BLOCK_T rows × BLOCK_N key columns. When its rows share one k_start (every
block of a one-request batch), the key tile is gathered and decoded once and each head is one
[BLOCK_T, D] × [D, BLOCK_N] product whose relu is weighted and added into the fp32 tile, heads
in order 0…H−1. Blocks whose rows straddle requests (other k_starts) go row by row, all heads in
one product. quant="qat" rounds as the reference's bf16 einsum (`ops.attention_quant.
index_scores_qat`): each head's score to bf16, relu, times the bf16 weight rounded to bf16, heads
added in fp32, one bf16 rounding at the end; the fp4 products are exact and a 128-dim fp32 sum of
them is exact unless block scales differ by about 2^10, so the two agree but where that sum or
the row-by-row head sum (a tree, not 0…H−1) rounds differently: at most one bf16 ulp, rarely.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv4cp.kernels._triton import dot_flags
from dsv4cp.kernels.index_score import add_heads, head_term, index_score
from dsv4cp.kernels.kv_decode import FORMAT_CODES, load_key_rows
from dsv4cp.ops.kv_format import check_format, row_width
from dsv4cp.ops.quant import QuantMode, check_quant_mode

# (BLOCK_T, BLOCK_N, num_warps, num_stages): not tuned on the H200 yet (see docs/caches.md).
DEFAULT_CONFIG = (64, 64, 4, 2)
_DOT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _key_tile(kc_ptr, krows_ptr, entries, ok, d, stride_kc, D: tl.constexpr, FMT: tl.constexpr):
    """Decoded keys [BLOCK_N, D] of workspace entries (masked lanes 0), transposed [D, BLOCK_N]."""
    rows = tl.load(krows_ptr + entries, mask=ok, other=0)
    ptrs = kc_ptr + rows[:, None].to(tl.int64) * stride_kc
    return tl.trans(load_key_rows(ptrs, d, ok[:, None], D, FMT))


@triton.jit
def _mqa_logits_cached_kernel(
    q_ptr,
    w_ptr,
    kc_ptr,
    krows_ptr,
    nvis_ptr,
    kstart_ptr,
    out_ptr,
    T,
    H,
    N,
    WIDTH,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_kc,
    stride_ot,
    D: tl.constexpr,
    H_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FMT: tl.constexpr,
    QAT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    RNE: tl.constexpr,
    PACKED: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    nvis = tl.minimum(tl.load(nvis_ptr + rows, mask=row_ok, other=0).to(tl.int32), WIDTH)
    ks = tl.load(kstart_ptr + rows, mask=row_ok, other=0).to(tl.int32)
    ks_lo = tl.min(tl.where(row_ok, ks, 2147483647), 0)
    col_ok = cols < WIDTH
    if ks_lo == tl.max(tl.where(row_ok, ks, -1), 0):
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        max_vis = tl.max(nvis, 0)
        if pid_n * BLOCK_N < max_vis:
            ok = (cols < max_vis) & (ks_lo + cols < N)
            kt = _key_tile(kc_ptr, krows_ptr, ks_lo + cols, ok, d, stride_kc, D, FMT)
            if UPCAST:
                kt = kt.to(tl.float32)
            else:
                kt = kt.to(q_ptr.dtype.element_ty)  # decoded values are exact in bf16
            q_ptrs = q_ptr + rows[:, None].to(tl.int64) * stride_qt + d[None, :]
            w_ptrs = w_ptr + rows.to(tl.int64) * stride_wt
            acc = add_heads(
                acc, q_ptrs, w_ptrs, kt, row_ok, H, stride_qh, QAT, RNE,
                PACKED, UPCAST, DOT_PREC, None,
            )  # fmt: skip
        acc = index_score(acc, QAT, RNE, PACKED)
        visible = cols[None, :] < nvis[:, None]
        tl.store(
            out_ptr + rows[:, None].to(tl.int64) * stride_ot + cols[None, :],
            tl.where(visible, acc, float("-inf")),
            mask=row_ok[:, None] & col_ok[None, :],
        )
    else:
        hh = tl.arange(0, H_PAD)
        h_ok = hh < H
        for r in range(BLOCK_T):
            t = pid_t * BLOCK_T + r
            if t < T:
                t64 = t.to(tl.int64)
                ks_t = tl.load(kstart_ptr + t).to(tl.int32)
                nv_t = tl.minimum(tl.load(nvis_ptr + t).to(tl.int32), WIDTH)
                ok = (cols < nv_t) & (ks_t + cols < N)
                kt = _key_tile(kc_ptr, krows_ptr, ks_t + cols, ok, d, stride_kc, D, FMT)
                qt = tl.load(
                    q_ptr + t64 * stride_qt + hh[:, None] * stride_qh + d[None, :],
                    mask=h_ok[:, None],
                    other=0.0,
                )
                if UPCAST:
                    kt = kt.to(tl.float32)
                    qt = qt.to(tl.float32)
                else:
                    kt = kt.to(qt.dtype)
                wt = tl.load(w_ptr + t64 * stride_wt + hh, mask=h_ok, other=0.0)
                s = tl.dot(qt, kt, input_precision=DOT_PREC)
                row = tl.sum(head_term(s, wt[:, None], QAT, RNE, PACKED), 0)
                row = index_score(row, QAT, RNE, PACKED)
                row = tl.where(cols < nv_t, row, float("-inf"))
                tl.store(out_ptr + t64 * stride_ot + cols, row, mask=col_ok)


def check_mqa_logits_cached(
    q: Tensor, weights: Tensor, k_cache: Tensor, k_rows: Tensor, n_visible: Tensor, k_format: str
) -> None:
    """Raise ValueError naming the limit when the kernel cannot take these shapes."""
    name = "mqa_logits_cached"
    if q.dim() != 3:
        raise ValueError(f"{name}: q must be [T, H_I, D_I], got {tuple(q.shape)}")
    t, h, d = q.shape
    if d < 32 or d > 256 or d & (d - 1):
        raise ValueError(f"{name} kernel: D_I must be a power of two in [32, 256], got {d}")
    if h < 1 or h > 128:
        raise ValueError(f"{name} kernel: H_I must be in [1, 128], got {h}")
    fmt = check_format(k_format)
    width = row_width(fmt, d)
    want = q.dtype if fmt == "dense" else torch.uint8
    if k_cache.dim() != 2 or k_cache.shape[1] != width or k_cache.dtype != want:
        raise ValueError(
            f"{name}: k_cache must be {want} [N, {width}] ({fmt}), got {k_cache.dtype} "
            f"{tuple(k_cache.shape)}"
        )
    if k_rows.dim() != 1:
        raise ValueError(f"{name}: k_rows must be [N], got {tuple(k_rows.shape)}")
    if weights.shape != (t, h):
        raise ValueError(f"{name}: weights must be [{t}, {h}], got {tuple(weights.shape)}")
    if n_visible.shape != (t,):
        raise ValueError(f"{name}: n_visible must be [{t}], got {tuple(n_visible.shape)}")
    if q.dtype not in _DOT_DTYPES:
        raise ValueError(f"{name} kernel: q must be bf16/fp16/fp32, got {q.dtype}")


def mqa_logits_cached(
    q: Tensor,
    weights: Tensor,
    k_cache: Tensor,
    k_rows: Tensor,
    n_visible: Tensor,
    *,
    k_start: Tensor | None = None,
    width: int | None = None,
    k_format: str = "dense",
    quant: QuantMode = "none",
) -> Tensor:
    """Triton twin of ops.indexer_cached.mqa_logits_cached: fp32 [T, width]."""
    return launch_mqa_logits_cached(
        q,
        weights,
        k_cache,
        k_rows,
        n_visible,
        k_start=k_start,
        width=width,
        k_format=k_format,
        quant=quant,
    )


def launch_mqa_logits_cached(
    q: Tensor,
    weights: Tensor,
    k_cache: Tensor,
    k_rows: Tensor,
    n_visible: Tensor,
    *,
    k_start: Tensor | None = None,
    width: int | None = None,
    k_format: str = "dense",
    quant: QuantMode = "none",
    config: tuple[int, int, int, int] | None = None,
) -> Tensor:
    """mqa_logits_cached with an explicit (BLOCK_T, BLOCK_N, num_warps, num_stages)."""
    check_mqa_logits_cached(q, weights, k_cache, k_rows, n_visible, k_format)
    qat = check_quant_mode(quant) == "qat"
    t, h, d = q.shape
    n = k_rows.shape[0]
    width = n if width is None else int(width)
    out = torch.empty((t, width), dtype=torch.float32, device=q.device)
    if t == 0 or width == 0:
        return out
    if n == 0:
        return out.fill_(float("-inf"))
    q = q if q.stride(2) == 1 else q.contiguous()
    k_cache = k_cache if k_cache.stride(1) == 1 else k_cache.contiguous()
    weights = weights.float().contiguous()
    k_rows = k_rows.long().clamp_min(0).contiguous()
    if k_start is None:
        k_start = torch.zeros(t, dtype=torch.long, device=q.device)
    elif k_start.shape != (t,):
        raise ValueError(f"mqa_logits_cached: k_start must be [{t}], got {tuple(k_start.shape)}")
    block_t, block_n, warps, stages = config or DEFAULT_CONFIG
    grid = (triton.cdiv(width, block_n), triton.cdiv(t, block_t))
    _mqa_logits_cached_kernel[grid](
        q,
        weights,
        k_cache,
        k_rows,
        n_visible.contiguous(),
        k_start.contiguous(),
        out,
        t,
        h,
        n,
        width,
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        k_cache.stride(0),
        out.stride(0),
        D=d,
        H_PAD=max(16, triton.next_power_of_2(h)),
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        FMT=FORMAT_CODES[k_format],
        QAT=qat,
        **dot_flags(q.dtype),
        PACKED=True,  # the qat steps two values per asm block (not in the interpreter: RNE)
        num_warps=warps,
        num_stages=stages,
    )
    return out
