"""Indexer logits fused with their selections: the [rows, width] logits never reach memory.

Twins of `dsv4cp.ops.indexer_topk` (attention-math §5.3): `mqa_topk` (full top-k),
`mqa_topk_candidates` (top-k plus the candidate source's published blocks) and
`mqa_topk_among_blocks` (a candidate consumer's top-k among its published blocks).

`_scan_kernel`: one program per (row block of BLOCK_T rows, piece of the width). Per tile of
BLOCK_N key columns it forms the logits tile as `kernels/indexer_logits` does (the key tile loaded
once, one tensor-core product per head, relu, weighted sum in fp32 registers), then keeps each
row's running selection in a small buffer of CAP (order-preserving int32 key, column) pairs in
column order. A column enters when its key beats the row's threshold τ, the K-th largest key seen
so far (INT_MIN until the row has seen K). When a row's buffer is nearly full, every row's buffer
is cut to exactly its top K by (key desc, column asc): the 32-step bitwise search of
`kernels/topk.py`, vectorised over rows, then a stable compaction; τ rises. A later column enters
only if its key is > τ: on a tie it loses to the K buffered keys, which all have smaller columns.
After the last tile the buffer is the piece's exact top K in the total order of
`ops.indexer._pick_topk` (value, then the smaller index). With one piece the program writes the
answer; otherwise `_merge_kernel` takes, per row, the top K of the pieces' buffers (≤ pieces·K
keys, in column order) in registers.

Modes (constexpr flags of the same kernel):
- BLOCK_MAX, the candidate source: each tile also writes the max visible logit of every block of
  BS columns (the newest block +inf) into a [rows, blocks] fp32 buffer, 1/BS of the logits, from
  which `kernels.topk` selects the published blocks (`candidate_blocks` for finite logits).
- MEMBER, a candidate consumer: a column is a candidate only if its block is in the row's
  published list (a [rows, blocks] byte map written by `_member_kernel`) and its logit is finite.
  Every visible column is still scored; the selection, not the product, is restricted.

`_gather_kernel`, a candidate consumer at long context (the width ≥ GATHER_WIDTH_RATIO times the
published positions): per row, only the keys of its published blocks are loaded and scored, all
heads of the row in one tensor-core product per tile of blocks, with the same running buffer,
cut by `_cut_rows`; the block ids are sorted and deduplicated first so that columns arrive in
ascending order, which the tie rule needs.

A row block whose rows have different k_start (a request boundary inside the block) is done in
segments, one pass over the piece per distinct k_start, the other rows masked.

quant="qat" (QAT constexpr): each head's term is the reference's bf16 steps, bf16(relu(bf16(s)) ·
bf16(w)), added in fp32 in head order 0…H−1 (the gather kernel: a tree over the heads) and the
sum rounded to bf16 once: the index scores of `ops.attention_quant.index_scores_qat`. The fp4 ×
fp4 products are exact and the fp32 dot of D_I of them is exact unless the block scales differ by
about 2^10, so the scores equal the twin's but where that sum rounds; on one GPU the selection is
a deterministic function of each row (CP = N equals CP = 1 bit for bit).

`mqa_topk_cached` (the layer's call) reads the keys from the index-key cache: the workspace
entries' rows decoded once into a dense [N, D_I] workspace in q.dtype (bounded by the batch's
entries: 256 B per entry in bf16), then the scan.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv4cp.kernels._triton import interpreting, to_dtype
from dsv4cp.kernels.indexer_logits import check_mqa_logits
from dsv4cp.kernels.kv_decode import decode_gather
from dsv4cp.kernels.topk import _kth_key, _sortable, _store_prefix, _store_selection
from dsv4cp.kernels.topk import launch_topk as _launch_topk
from dsv4cp.ops.kv_format import check_format
from dsv4cp.ops.quant import QuantMode, check_quant_mode

MAX_K = 2048
MAX_MERGE = 16384  # pieces · K keys merged in registers per row
MIN_PIECE = 4096  # narrowest piece worth a program
SCRATCH_BUDGET_BYTES = 512 << 20  # row-selection buffers (+ block maxima / map) per launch
GATHER_WIDTH_RATIO = 4  # a consumer gathers its blocks when the width is ≥ 4x their positions
# (BLOCK_T, BLOCK_N, num_warps, num_stages): the mqa_logits kernel's H200 default.
DEFAULT_CONFIG = (64, 128, 4, 2)
_INT_MIN = -2147483648


@triton.jit
def _term(s, w, QAT: tl.constexpr, RNE: tl.constexpr):
    """One head's relu(s)·w in fp32, or the reference's bf16 steps under qat:
    bf16(relu(bf16(s)) · bf16(w)) (`ops.attention_quant.index_scores_qat`)."""
    if QAT:
        sb = to_dtype(s, tl.bfloat16, RNE).to(tl.float32)
        wb = to_dtype(w, tl.bfloat16, RNE).to(tl.float32)
        return to_dtype(tl.maximum(sb, 0.0) * wb, tl.bfloat16, RNE).to(tl.float32)
    else:
        return tl.maximum(s, 0.0) * w


@triton.jit
def _logit(acc, QAT: tl.constexpr, RNE: tl.constexpr):
    """The head sum as the index score: one bf16 rounding under qat."""
    if QAT:
        return to_dtype(acc, tl.bfloat16, RNE).to(tl.float32)
    else:
        return acc


@triton.jit
def _kth_rows(keys, R: tl.constexpr, K: tl.constexpr):
    """Per row of `keys` [R, C] (int32; INT_MIN pads never counted): its K-th largest key, or
    INT_MIN when the row has fewer than K keys."""
    tau_u = tl.zeros([R], dtype=tl.int64)  # built bit by bit in the unsigned image key + 2^31
    one = tl.full([R], 1, tl.int64)
    for i in range(32):
        cand_u = tau_u + (one << (31 - i))
        cand = (cand_u - 2147483648).to(tl.int32)
        cnt = tl.sum((keys >= cand[:, None]).to(tl.int32), 1)
        tau_u = tl.where(cnt >= K, cand_u, tau_u)
    return (tau_u - 2147483648).to(tl.int32)


@triton.jit
def _cut_rows(
    sk_ptr, si_ptr, cnt_ptr, tau_ptr, slots, ok,
    R: tl.constexpr, CAP: tl.constexpr, K: tl.constexpr,
):  # fmt: skip
    """Cut the buffers of `slots` [R] to their top K (stable) and publish count and τ."""
    j = tl.arange(0, CAP)
    c = tl.load(cnt_ptr + slots, mask=ok, other=0)
    live = j[None, :] < c[:, None]
    at = slots[:, None] * CAP + j[None, :]
    keys = tl.load(sk_ptr + at, mask=live, other=-2147483648)
    idx = tl.load(si_ptr + at, mask=live, other=0)
    tau = _kth_rows(keys, R, K)
    gt = keys > tau[:, None]
    eq = (keys == tau[:, None]) & live
    need = K - tl.sum(gt.to(tl.int32), 1)
    sel = gt | (eq & (tl.cumsum(eq.to(tl.int32), 1) <= need[:, None]))
    to = slots[:, None] * CAP + tl.cumsum(sel.to(tl.int32), 1) - 1
    tl.debug_barrier()  # every thread has read its keys before any is overwritten
    tl.store(sk_ptr + to, keys, mask=sel)
    tl.store(si_ptr + to, idx, mask=sel)
    tl.store(cnt_ptr + slots, tl.sum(sel.to(tl.int32), 1), mask=ok)
    tl.store(tau_ptr + slots, tau, mask=ok)


@triton.jit
def _cut_block(
    sk_ptr, si_ptr, cnt_ptr, tau_ptr, first_row, T, piece, PIECES,
    BLOCK_T: tl.constexpr, RG: tl.constexpr, CAP: tl.constexpr, K: tl.constexpr,
):  # fmt: skip
    """Cut every row buffer of the row block, RG rows at a time."""
    tl.debug_barrier()  # the appended pairs and counts are visible to every thread
    for g in range(0, BLOCK_T, RG):
        r = first_row + g + tl.arange(0, RG)
        slots = r.to(tl.int64) * PIECES + piece
        _cut_rows(sk_ptr, si_ptr, cnt_ptr, tau_ptr, slots, r < T, RG, CAP, K)
    tl.debug_barrier()


@triton.jit
def _scan_kernel(
    q_ptr, w_ptr, k_ptr, nvis_ptr, kstart_ptr, member_ptr, bmax_ptr,
    sk_ptr, si_ptr, cnt_ptr, tau_ptr, out_ptr,
    T, H, N, WIDTH, PIECES, PIECE_W, NB,
    stride_qt, stride_qh, stride_wt, stride_kn, stride_ot,
    K: tl.constexpr, K_PAD: tl.constexpr, CAP: tl.constexpr, RG: tl.constexpr,
    HAS_KSTART: tl.constexpr, MEMBER: tl.constexpr, BLOCK_MAX: tl.constexpr, BS: tl.constexpr,
    DIRECT: tl.constexpr, PREFIX: tl.constexpr,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, QAT: tl.constexpr, RNE: tl.constexpr,
):  # fmt: skip
    first_row = tl.program_id(0) * BLOCK_T
    piece = tl.program_id(1)
    rows = first_row + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    slots = rows64 * PIECES + piece
    d = tl.arange(0, D)
    nv_raw = tl.load(nvis_ptr + rows, mask=row_ok, other=0).to(tl.int32)
    nv = tl.maximum(tl.minimum(nv_raw, WIDTH), 0)
    if HAS_KSTART:
        ks = tl.load(kstart_ptr + rows, mask=row_ok, other=0).to(tl.int32)
    else:
        ks = tl.zeros([BLOCK_T], dtype=tl.int32)
    c0 = piece * PIECE_W
    c1 = tl.minimum(c0 + PIECE_W, WIDTH)
    cnt = tl.zeros([BLOCK_T], dtype=tl.int32)
    tau = tl.full([BLOCK_T], -2147483648, tl.int32)
    done = (rows >= T).to(tl.int32)
    while tl.min(done, 0) == 0:  # one segment per distinct k_start
        ks_cur = tl.min(tl.where(done != 0, 2147483647, ks), 0)
        active = (done == 0) & (ks == ks_cur)
        hi = tl.minimum(c1, tl.max(tl.where(active, nv, 0), 0))
        for n0 in range(c0, hi, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            key_rows = ks_cur + cols
            kt = tl.load(
                k_ptr + key_rows[None, :].to(tl.int64) * stride_kn + d[:, None],
                mask=((cols < hi) & (key_rows < N))[None, :],
                other=0.0,
            )
            if UPCAST:
                kt = kt.to(tl.float32)
            acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
            q_ptrs = q_ptr + rows64[:, None] * stride_qt + d[None, :]
            w_ptrs = w_ptr + rows64 * stride_wt
            for _ in tl.range(0, H, num_stages=STAGES):
                qh = tl.load(q_ptrs, mask=active[:, None], other=0.0)
                wh = tl.load(w_ptrs, mask=active, other=0.0)
                if UPCAST:
                    qh = qh.to(tl.float32)
                s = tl.dot(qh, kt, input_precision=DOT_PREC)
                acc += _term(s, wh[:, None], QAT, RNE)
                q_ptrs += stride_qh
                w_ptrs += 1
            acc = _logit(acc, QAT, RNE)
            vis = active[:, None] & (cols[None, :] < nv[:, None])
            if BLOCK_MAX:
                blk = tl.max(
                    tl.reshape(tl.where(vis, acc, float("-inf")), [BLOCK_T, BLOCK_N // BS, BS]), 2
                )
                bcol = n0 // BS + tl.arange(0, BLOCK_N // BS)
                newest = (nv_raw - 1) // BS
                forced = (bcol[None, :] == newest[:, None]) & (nv_raw > 0)[:, None]
                tl.store(
                    bmax_ptr + rows64[:, None] * NB + bcol[None, :],
                    tl.where(forced, float("inf"), blk),
                    mask=active[:, None] & (bcol < NB)[None, :],
                )
            elig = vis
            if MEMBER:
                member = tl.load(member_ptr + rows64[:, None] * NB + cols[None, :] // BS, mask=vis)
                elig = vis & (member != 0) & (acc > float("-inf"))
            key = _sortable(acc)  # acc starts at +0.0 and adds products: never -0.0
            take = elig & (key > tau[:, None])
            n_take = tl.sum(take.to(tl.int32), 1)
            if tl.max(n_take, 0) > 0:
                at = slots[:, None] * CAP + cnt[:, None] + tl.cumsum(take.to(tl.int32), 1) - 1
                tl.store(sk_ptr + at, key, mask=take)
                tl.store(si_ptr + at, cols[None, :] + tl.zeros_like(key), mask=take)
                cnt += n_take
                if tl.max(cnt, 0) > CAP - BLOCK_N:  # a buffer could overflow at the next tile
                    tl.store(cnt_ptr + slots, cnt, mask=row_ok)
                    _cut_block(
                        sk_ptr, si_ptr, cnt_ptr, tau_ptr, first_row, T, piece, PIECES,
                        BLOCK_T, RG, CAP, K,
                    )  # fmt: skip
                    cnt = tl.load(cnt_ptr + slots, mask=row_ok, other=0)
                    tau = tl.load(tau_ptr + slots, mask=row_ok, other=-2147483648)
        done = tl.where(active, 1, done)
    tl.store(cnt_ptr + slots, cnt, mask=row_ok)
    _cut_block(sk_ptr, si_ptr, cnt_ptr, tau_ptr, first_row, T, piece, PIECES, BLOCK_T, RG, CAP, K)
    if DIRECT:  # one piece: the buffers are the answer (ascending columns, -1 pads)
        o = tl.arange(0, K_PAD)
        for g in range(0, BLOCK_T, RG):
            r = first_row + g + tl.arange(0, RG)
            r_ok = r < T
            r64 = r.to(tl.int64)
            c = tl.load(cnt_ptr + r64, mask=r_ok, other=0)
            sel = tl.load(si_ptr + r64[:, None] * CAP + o[None, :], mask=o[None, :] < c[:, None])
            sel = tl.where(o[None, :] < c[:, None], sel, -1)
            if PREFIX:  # n ≤ K: every visible column, whatever its logit
                n = tl.minimum(tl.load(nvis_ptr + r, mask=r_ok, other=0).to(tl.int32), WIDTH)
                n = tl.maximum(n, 0)
                prefix = tl.where(o[None, :] < n[:, None], o[None, :], -1)
                sel = tl.where((n <= K)[:, None], prefix, sel)
            tl.store(
                out_ptr + r64[:, None] * stride_ot + o[None, :],
                sel,
                mask=r_ok[:, None] & (o < K)[None, :],
            )


@triton.jit
def _merge_kernel(
    sk_ptr, si_ptr, cnt_ptr, nvis_ptr, out_ptr, WIDTH, PIECES, stride_ot,
    K: tl.constexpr, K_PAD: tl.constexpr, P_PAD: tl.constexpr, CAP: tl.constexpr,
    PREFIX: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    out_row = out_ptr + row * stride_ot
    n = tl.maximum(tl.minimum(tl.load(nvis_ptr + row).to(tl.int32), WIDTH), 0)
    if PREFIX and n <= K:
        _store_prefix(out_row, n, K, K_PAD)
    else:
        p = tl.arange(0, P_PAD)
        o = tl.arange(0, K_PAD)
        c = tl.load(cnt_ptr + row * PIECES + p, mask=p < PIECES, other=0)
        live = o[None, :] < c[:, None]
        at = (row * PIECES + p)[:, None] * CAP + o[None, :]
        keys = tl.reshape(tl.load(sk_ptr + at, mask=live, other=-2147483648), [P_PAD * K_PAD])
        idx = tl.reshape(tl.load(si_ptr + at, mask=live, other=0), [P_PAD * K_PAD])
        total = tl.minimum(tl.sum(c, 0), K)
        tl.store(out_row + o, tl.full([K_PAD], -1, tl.int32), mask=(o >= total) & (o < K))
        _store_selection(keys, idx, keys > -2147483648, _kth_key(keys, K), out_row, K)


@triton.jit
def _gather_kernel(
    q_ptr, w_ptr, k_ptr, nvis_ptr, kstart_ptr, ids_ptr, sk_ptr, si_ptr, cnt_ptr, tau_ptr, out_ptr,
    T, H, N, WIDTH, NB, MB,
    stride_qt, stride_qh, stride_wt, stride_kn, stride_it, stride_ot,
    K: tl.constexpr, K_PAD: tl.constexpr, CAP: tl.constexpr, HAS_KSTART: tl.constexpr,
    D: tl.constexpr, H_PAD: tl.constexpr, BS: tl.constexpr, BPT: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, QAT: tl.constexpr, RNE: tl.constexpr,
):  # fmt: skip
    # A consumer at long context: per row, only its published blocks (ascending ids, -1 skipped)
    # are scored, BPT blocks of BS keys per tile, all heads of the row in one product.
    pid = tl.program_id(0)
    slot = pid + tl.arange(0, 1)  # this program's buffer (rows pid, pid + grid, ...)
    d = tl.arange(0, D)
    hh = tl.arange(0, H_PAD)
    o = tl.arange(0, K_PAD)
    bj = tl.arange(0, BPT)
    off = tl.arange(0, BS)
    for row in range(pid, T, tl.num_programs(0)):
        r64 = row * tl.full([], 1, tl.int64)  # row is a plain int in the interpreter
        n = tl.maximum(tl.minimum(tl.load(nvis_ptr + r64).to(tl.int32), WIDTH), 0)
        ks = 0
        if HAS_KSTART:
            ks = tl.load(kstart_ptr + r64).to(tl.int32)
        qt = tl.load(
            q_ptr + r64 * stride_qt + hh[:, None] * stride_qh + d[None, :],
            mask=(hh < H)[:, None],
            other=0.0,
        )
        if UPCAST:
            qt = qt.to(tl.float32)
        wt = tl.load(w_ptr + r64 * stride_wt + hh, mask=hh < H, other=0.0)
        cnt = tl.zeros([1], dtype=tl.int32)
        tau = tl.full([1], -2147483648, tl.int32)
        for b0 in range(0, MB, BPT):
            ids = tl.load(ids_ptr + r64 * stride_it + b0 + bj, mask=b0 + bj < MB, other=-1)
            ok = (ids >= 0) & (ids < NB)
            cols = tl.reshape(ids[:, None] * BS + off[None, :], [BPT * BS])
            valid = tl.reshape(ok[:, None] & (off >= 0)[None, :], [BPT * BS]) & (cols < n)
            kt = tl.load(
                k_ptr + (ks + cols)[None, :].to(tl.int64) * stride_kn + d[:, None],
                mask=(valid & (ks + cols < N))[None, :],
                other=0.0,
            )
            if UPCAST:
                kt = kt.to(tl.float32)
            s = tl.dot(qt, kt, input_precision=DOT_PREC)
            logit = _logit(tl.sum(_term(s, wt[:, None], QAT, RNE), 0), QAT, RNE)
            key = _sortable(logit)
            take = valid & (logit > float("-inf")) & (key > tau)
            n_take = tl.sum(take.to(tl.int32), 0)
            if n_take > 0:
                at = pid.to(tl.int64) * CAP + cnt + tl.cumsum(take.to(tl.int32), 0) - 1
                tl.store(sk_ptr + at, key, mask=take)
                tl.store(si_ptr + at, cols, mask=take)
                cnt += n_take
                if tl.max(cnt, 0) > CAP - BPT * BS:
                    tl.store(cnt_ptr + slot, cnt)
                    tl.debug_barrier()
                    _cut_rows(
                        sk_ptr, si_ptr, cnt_ptr, tau_ptr, slot.to(tl.int64), slot >= 0, 1, CAP, K
                    )
                    tl.debug_barrier()
                    cnt = tl.load(cnt_ptr + slot)
                    tau = tl.load(tau_ptr + slot)
        tl.store(cnt_ptr + slot, cnt)
        tl.debug_barrier()
        _cut_rows(sk_ptr, si_ptr, cnt_ptr, tau_ptr, slot.to(tl.int64), slot >= 0, 1, CAP, K)
        tl.debug_barrier()
        c = tl.max(tl.load(cnt_ptr + slot), 0)
        sel = tl.load(si_ptr + pid.to(tl.int64) * CAP + o, mask=o < c, other=-1)
        tl.store(out_ptr + r64 * stride_ot + o, tl.where(o < c, sel, -1), mask=o < K)
        tl.debug_barrier()  # the next row reuses the buffer


@triton.jit
def _member_kernel(ids_ptr, member_ptr, NB, MB, stride_it, MB_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, MB_PAD)
    ids = tl.load(ids_ptr + row * stride_it + j, mask=j < MB, other=-1)
    ok = (ids >= 0) & (ids < NB)
    tl.store(member_ptr + row * NB + ids, tl.full([MB_PAD], 1, tl.uint8), mask=ok)


# ---------------------------------------------------------------------------------------- host


def check_mqa_topk(q: Tensor, weights: Tensor, k: Tensor, n_visible: Tensor, k_top: int) -> None:
    """Raise ValueError naming the limit when the kernels cannot take these shapes."""
    check_mqa_logits(q, weights, k, n_visible)
    if not 1 <= k_top <= MAX_K:
        raise ValueError(f"mqa_topk kernel: k_top must be in [1, {MAX_K}], got {k_top}")


def _pieces(rows: int, width: int, block_t: int, block_n: int, k_pad: int, device: torch.device):
    """(pieces, piece width): split the width when the row blocks alone do not fill the GPU."""
    sms = (
        4
        if device.type != "cuda"
        else torch.cuda.get_device_properties(device).multi_processor_count
    )
    row_blocks = triton.cdiv(rows, block_t)
    want = triton.cdiv(2 * sms, row_blocks)
    most = max(1, min(triton.cdiv(width, MIN_PIECE), MAX_MERGE // k_pad))
    pieces = max(1, min(want, most))
    piece_w = triton.cdiv(triton.cdiv(width, pieces), block_n) * block_n
    return triton.cdiv(width, piece_w), piece_w


def launch_mqa_topk(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    n_visible: Tensor,
    k_top: int,
    *,
    k_start: Tensor | None = None,
    width: int | None = None,
    block_ids: Tensor | None = None,
    block_size: int = 8,
    max_blocks: int = 0,
    config: tuple[int, int, int, int] | None = None,
    pieces: int | None = None,
    cap: int | None = None,
    row_group: int = 4,
    consumer: str = "auto",
    quant: QuantMode = "none",
) -> tuple[Tensor, Tensor | None]:
    """The three ops in one launcher: full top-k; with `max_blocks` > 0 also the candidate
    source's blocks; with `block_ids` the consumer's top-k among them. Knobs for benchmarks and
    tests: `config` (BLOCK_T, BLOCK_N, num_warps, num_stages), `pieces` (width splits), `cap`
    (row-buffer entries, a power of two ≥ k_top + BLOCK_N), `row_group` (rows cut at once),
    `consumer`: "map" scores every visible key and selects in the published blocks, "gather"
    scores only the published blocks' keys, "auto" gathers when the width is at least
    GATHER_WIDTH_RATIO times the published positions. `quant="qat"`: the reference's bf16 index
    scores (each head's term rounded as `index_scores_qat`, the head sum rounded once)."""
    check_mqa_topk(q, weights, k, n_visible, k_top)
    qat = check_quant_mode(quant) == "qat"
    t, h, d = q.shape
    n = k.shape[0]
    width = n if width is None else int(width)
    member_mode = block_ids is not None
    if member_mode and max_blocks:
        raise ValueError("mqa_topk kernel: block_ids (consumer) and max_blocks (source) exclude")
    if (member_mode or max_blocks) and (block_size < 1 or block_size & (block_size - 1)):
        raise ValueError(f"mqa_topk kernel: block_size must be a power of two, got {block_size}")
    if k_start is not None and k_start.shape != (t,):
        raise ValueError(f"mqa_topk: k_start must be [{t}], got {tuple(k_start.shape)}")
    if block_ids is not None and (block_ids.dim() != 2 or block_ids.shape[0] != t):
        raise ValueError(f"mqa_topk: block_ids must be [{t}, B], got {tuple(block_ids.shape)}")
    block_t, block_n, warps, stages = config or DEFAULT_CONFIG
    if (member_mode or max_blocks) and block_n % block_size:
        raise ValueError(f"mqa_topk kernel: BLOCK_N {block_n} not a multiple of {block_size}")
    k_pad = triton.next_power_of_2(k_top)
    cap = cap or triton.next_power_of_2(max(2 * k_top, k_top + 2 * block_n))
    if cap & (cap - 1) or cap < k_top + block_n:
        raise ValueError(f"mqa_topk kernel: cap {cap} must be a power of two ≥ k_top + BLOCK_N")
    out = torch.empty((t, k_top), dtype=torch.int32, device=q.device)
    blocks_out = (
        torch.empty((t, max_blocks), dtype=torch.int32, device=q.device) if max_blocks else None
    )
    if t == 0:
        return out, blocks_out
    if width == 0:
        out.fill_(-1)
        if blocks_out is not None:
            blocks_out.fill_(-1)
        return out, blocks_out
    if q.stride(2) != 1:
        q = q.contiguous()
    if k.stride(1) != 1:
        k = k.contiguous()
    weights = weights.float()
    if weights.stride(1) != 1:
        weights = weights.contiguous()
    n_visible = n_visible.contiguous()
    nb = triton.cdiv(width, block_size) if (member_mode or max_blocks) else 1
    if block_ids is not None:
        if consumer not in ("auto", "map", "gather"):
            raise ValueError(f"mqa_topk kernel: consumer must be auto/map/gather, got {consumer!r}")
        wide = width >= GATHER_WIDTH_RATIO * block_ids.shape[1] * block_size
        if consumer == "gather" or (consumer == "auto" and wide):
            _launch_gather(q, weights, k, n_visible, k_start, block_ids, out, width, block_size,
                           block_n, cap, nb, qat)  # fmt: skip
            return out, None
    upcast = interpreting() and q.dtype != torch.float32
    prec = "ieee" if q.dtype == torch.float32 else "tf32"

    def plan(rows: int) -> tuple[int, int]:
        if pieces is None:
            return _pieces(rows, width, block_t, block_n, k_pad, q.device)
        piece_w = triton.cdiv(triton.cdiv(width, pieces), block_n) * block_n
        return triton.cdiv(width, piece_w), piece_w

    # Rows per launch: whole row blocks whose buffers (and block maxima or map) fit the budget.
    step = t
    while step > block_t and step * (8 * cap * plan(step)[0] + 5 * nb) > SCRATCH_BUDGET_BYTES:
        step = max(block_t, step // 2 // block_t * block_t)
    for a in range(0, t, step):
        b = min(t, a + step)
        rows = b - a
        p, piece_w = plan(rows)
        sk = torch.empty((rows * p, cap), dtype=torch.int32, device=q.device)
        si = torch.empty_like(sk)
        cnt = torch.empty((rows * p,), dtype=torch.int32, device=q.device)
        tau = torch.empty_like(cnt)
        nv = n_visible[a:b]
        bmax = torch.empty((rows, nb), dtype=torch.float32, device=q.device) if max_blocks else cnt
        member = cnt
        if member_mode:
            assert block_ids is not None
            ids = block_ids[a:b]
            if ids.stride(1) != 1:
                ids = ids.contiguous()
            member = torch.zeros((rows, nb), dtype=torch.uint8, device=q.device)
            if ids.shape[1]:
                _member_kernel[(rows,)](
                    ids, member, nb, ids.shape[1], ids.stride(0),
                    MB_PAD=triton.next_power_of_2(ids.shape[1]),
                )  # fmt: skip
        o = out[a:b]
        _scan_kernel[(triton.cdiv(rows, block_t), p)](
            q[a:b], weights[a:b], k, nv, nv if k_start is None else k_start[a:b].contiguous(),
            member, bmax, sk, si, cnt, tau, o,
            rows, h, n, width, p, piece_w, nb,
            q.stride(0), q.stride(1), weights.stride(0), k.stride(0), o.stride(0),
            K=k_top, K_PAD=k_pad, CAP=cap, RG=row_group,
            HAS_KSTART=k_start is not None, MEMBER=member_mode, BLOCK_MAX=bool(max_blocks),
            BS=block_size, DIRECT=p == 1, PREFIX=not member_mode,
            D=d, BLOCK_T=block_t, BLOCK_N=block_n, STAGES=stages, UPCAST=upcast, DOT_PREC=prec,
            QAT=qat, RNE=interpreting(), num_warps=warps, num_stages=stages,
        )  # fmt: skip
        if p > 1:
            _merge_kernel[(rows,)](
                sk, si, cnt, nv, o, width, p, o.stride(0),
                K=k_top, K_PAD=k_pad, P_PAD=triton.next_power_of_2(p), CAP=cap,
                PREFIX=not member_mode,
                num_warps=max(4, min(16, triton.next_power_of_2(max(1, p * k_pad // 1024)))),
            )  # fmt: skip
        if blocks_out is not None:
            n_blocks = (nv.clamp(0, width) + block_size - 1) // block_size
            blocks_out[a:b] = _launch_topk(bmax, n_blocks, max_blocks)
    return out, blocks_out


def _launch_gather(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    n_visible: Tensor,
    k_start: Tensor | None,
    block_ids: Tensor,
    out: Tensor,
    width: int,
    block_size: int,
    block_n: int,
    cap: int,
    nb: int,
    qat: bool = False,
) -> None:
    """The consumer's gather mode into `out`: ids sorted, duplicates dropped (the kernel appends
    columns in ascending order, which the tie rule needs), one buffer per program."""
    t, h, d = q.shape
    ids = block_ids.to(torch.int32).sort(dim=1).values
    dup = torch.zeros_like(ids, dtype=torch.bool)
    dup[:, 1:] = ids[:, 1:] == ids[:, :-1]
    ids = ids.masked_fill(dup, -1)
    dev = q.device
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 2
    grid = min(t, 8 * sms)
    sk = torch.empty((grid, cap), dtype=torch.int32, device=dev)
    si = torch.empty_like(sk)
    cnt = torch.empty((grid,), dtype=torch.int32, device=dev)
    tau = torch.empty_like(cnt)
    _gather_kernel[(grid,)](
        q, weights, k, n_visible, n_visible if k_start is None else k_start.contiguous(),
        ids, sk, si, cnt, tau, out,
        t, h, k.shape[0], width, nb, ids.shape[1],
        q.stride(0), q.stride(1), weights.stride(0), k.stride(0), ids.stride(0), out.stride(0),
        K=out.shape[1], K_PAD=triton.next_power_of_2(out.shape[1]), CAP=cap,
        HAS_KSTART=k_start is not None, D=d, H_PAD=max(16, triton.next_power_of_2(h)),
        BS=block_size, BPT=block_n // block_size,
        UPCAST=interpreting() and q.dtype != torch.float32,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        QAT=qat, RNE=interpreting(), num_warps=4,
    )  # fmt: skip


def mqa_topk(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    n_visible: Tensor,
    k_top: int,
    *,
    k_start: Tensor | None = None,
    width: int | None = None,
    quant: QuantMode = "none",
) -> Tensor:
    """Triton twin of ops.indexer_topk.mqa_topk: int32 [T, k_top], ascending, -1 pads."""
    return launch_mqa_topk(
        q, weights, k, n_visible, k_top, k_start=k_start, width=width, quant=quant
    )[0]


def mqa_topk_candidates(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    n_visible: Tensor,
    k_top: int,
    block_size: int,
    max_blocks: int,
    *,
    k_start: Tensor | None = None,
    width: int | None = None,
    quant: QuantMode = "none",
) -> tuple[Tensor, Tensor]:
    """Triton twin of ops.indexer_topk.mqa_topk_candidates (the blocks equal candidate_blocks
    whenever the visible logits are finite, as they are for finite inputs)."""
    if max_blocks < 1:
        raise ValueError(f"mqa_topk_candidates: max_blocks must be ≥ 1, got {max_blocks}")
    top, blocks = launch_mqa_topk(
        q, weights, k, n_visible, k_top,
        k_start=k_start, width=width, block_size=block_size, max_blocks=max_blocks, quant=quant,
    )  # fmt: skip
    assert blocks is not None
    return top, blocks


def mqa_topk_among_blocks(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    n_visible: Tensor,
    block_ids: Tensor,
    block_size: int,
    k_top: int,
    *,
    k_start: Tensor | None = None,
    width: int | None = None,
    quant: QuantMode = "none",
) -> Tensor:
    """Triton twin of ops.indexer_topk.mqa_topk_among_blocks: int32 [T, k_top], -1 pads."""
    return launch_mqa_topk(
        q, weights, k, n_visible, k_top,
        k_start=k_start, width=width, block_ids=block_ids, block_size=block_size, quant=quant,
    )[0]  # fmt: skip


def mqa_topk_cached(
    q: Tensor,
    weights: Tensor,
    k_cache: Tensor,
    k_rows: Tensor,
    n_visible: Tensor,
    k_top: int,
    *,
    k_start: Tensor | None = None,
    width: int | None = None,
    k_format: str = "dense",
    quant: QuantMode = "none",
    block_size: int = 1,
    max_blocks: int = 0,
    block_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Triton twin of ops.indexer_topk.mqa_topk_cached: the workspace entries' index keys decoded
    once into a dense workspace [N, D_I] in q.dtype (`kv_decode.decode_gather`: exact, 256 B per
    entry in bf16 at D_I = 128), then the fused scan (`launch_mqa_topk`)."""
    d = q.shape[-1]
    keys = index_workspace(k_cache, k_rows, k_format, d, q.dtype)
    if block_ids is not None and max_blocks:
        raise ValueError("mqa_topk_cached: block_ids (consumer) and max_blocks (source) exclude")
    return launch_mqa_topk(
        q, weights, keys, n_visible, k_top,
        k_start=k_start, width=width, block_ids=block_ids, block_size=block_size,
        max_blocks=max_blocks, quant=quant,
    )  # fmt: skip


def index_workspace(
    k_cache: Tensor, k_rows: Tensor, k_format: str, d: int, dtype: torch.dtype
) -> Tensor:
    """The keys of the workspace entries [N, d] in `dtype`, decoded from their cache rows (−1 rows
    read row 0, as the twin does: never visible by contract)."""
    check_format(k_format)
    if k_rows.dim() != 1:
        raise ValueError(f"mqa_topk_cached: k_rows must be [N], got {tuple(k_rows.shape)}")
    out = torch.empty((k_rows.shape[0], d), dtype=dtype, device=k_cache.device)
    return decode_gather(k_cache, k_rows.clamp_min(0), k_format, d, out)
