"""The fused scan: indexer logits formed tile by tile and kept only as each row's running top-k.

`scan_kernel`: one program per (row block of BLOCK_T rows, piece of the width). Per tile of
BLOCK_N key columns it forms the logits tile as `kernels/indexer_logits` does (the key tile loaded
once, one tensor-core product per head, relu, weighted sum in fp32 registers: `index_score`), then
appends the columns that beat each row's threshold to the row's running buffer; when a row's
buffer is nearly full, every row's buffer of the block is cut to its top K (`running_topk`).
With one piece (DIRECT) a last cut leaves the piece's exact top K and the program writes the
answer; otherwise `indexer_topk_merge.merge_kernel` merges the pieces' buffers — as they are
when all of them fit the merge's registers (no FINAL_CUT: a buffer holds its last cut's top K
and only keys above that cut's τ, so it contains the piece's top K in column order), else
after a last cut each.

Modes (constexpr flags of the same kernel):
- BLOCK_MAX, the candidate source: each tile also writes the max visible logit of every block of
  BS columns (the newest block +inf) into a [rows, blocks] fp32 buffer, 1/BS of the logits, from
  which `kernels.topk` selects the published blocks (`candidate_blocks` for finite logits).
- MEMBER, a candidate consumer: a column is a candidate only if its block is in the row's
  published list (a [rows, blocks] byte map written by `member_kernel`) and its logit is finite.
  Every visible column is still scored; the selection, not the product, is restricted.

A row block whose rows have different k_start (a request boundary inside the block) is done in
segments, one pass over the piece per distinct k_start, the other rows masked.

The seed (`indexer_topk_plan.plan_seed`), three launches of the same kernel:
- COL_STRIDE > 1, the sample: the scan over every COL_STRIDE-th visible column with K = the seed
  rank and a last cut, whose τ (the rank-th largest sampled key, INT_MIN when fewer) is the seed;
- SEEDED: the row's threshold starts at its seed (keys ≥ it are taken), not at INT_MIN, and a
  cut of a row holding fewer than K keys keeps that floor; the pieces then append a few thousand
  keys per row and rarely cut. A row whose buffers end with fewer than K keys (while it sees
  more than K columns) is flagged, by the direct write or by the merge (FLAG);
- REDO: the unseeded pass again, for the row blocks holding a flagged row only (the others
  return at once), and the merge of the flagged rows (REDO there too).

INT8 (qat, opt-in: `launch_mqa_topk(int8_scan=True)`): a tile whose active rows and keys are all
encoded exactly (`indexer_logits_int8.encode_int8`'s ok flags) takes that module's int8 head
loop (`int8_heads`) and the keys' 2^Ek, the others the bf16 steps: the same bits either way.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4cp.kernels.index_score import add_heads, index_score
from dsv4cp.kernels.indexer_logits_int8 import int8_heads
from dsv4cp.kernels.running_topk import cut_block
from dsv4cp.kernels.topk_common import sortable_key


@triton.jit
def scan_kernel(
    q_ptr, w_ptr, k_ptr, nvis_ptr, kstart_ptr, member_ptr, bmax_ptr,
    sk_ptr, si_ptr, cnt_ptr, tau_ptr, out_ptr, seed_ptr, redo_ptr,
    q8_ptr, w2_ptr, qok_ptr, k8_ptr, kscale_ptr, kok_ptr,
    T, H, N, WIDTH, PIECES, PIECE_W, NB,
    stride_qt, stride_qh, stride_wt, stride_kn, stride_ot,
    K: tl.constexpr, K_PAD: tl.constexpr, CAP: tl.constexpr, RG: tl.constexpr,
    KEY_BITS: tl.constexpr,
    HAS_KSTART: tl.constexpr, MEMBER: tl.constexpr, BLOCK_MAX: tl.constexpr, BS: tl.constexpr,
    DIRECT: tl.constexpr, PREFIX: tl.constexpr, FINAL_CUT: tl.constexpr,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, QAT: tl.constexpr, RNE: tl.constexpr,
    PACKED: tl.constexpr, COL_STRIDE: tl.constexpr, SEEDED: tl.constexpr, REDO: tl.constexpr,
    INT8: tl.constexpr, CVT: tl.constexpr, RELU_FMA: tl.constexpr,
):  # fmt: skip
    first_row = tl.program_id(0) * BLOCK_T
    piece = tl.program_id(1)
    rows = first_row + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    if REDO:  # the unseeded pass again, for the row blocks a seed left short only
        if tl.max(tl.load(redo_ptr + rows, mask=row_ok, other=0).to(tl.int32), 0) == 0:
            return
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
    if SEEDED:  # take keys ≥ the row's seed only (INT_MIN: no seed)
        seed = tl.load(seed_ptr + rows, mask=row_ok, other=-2147483648)
        tau = tl.where(seed > -2147483648, seed - 1, seed)
    floor = tau
    if INT8:  # the rows' encode_int8 flags (1: the exact int8 path holds the row)
        q_ok = tl.load(qok_ptr + rows, mask=row_ok, other=1).to(tl.int32)
    done = (rows >= T).to(tl.int32)
    while tl.min(done, 0) == 0:  # one segment per distinct k_start
        ks_cur = tl.min(tl.where(done != 0, 2147483647, ks), 0)
        active = (done == 0) & (ks == ks_cur)
        hi = tl.minimum(c1, tl.max(tl.where(active, nv, 0), 0))
        if INT8:  # the segment's rows only: the others read zeros either way
            q_exact = tl.min(tl.where(active, q_ok, 1), 0)
        for n0 in range(c0, hi, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            key_rows = ks_cur + cols * COL_STRIDE  # COL_STRIDE > 1: the seed's sample
            key_ok = (cols < hi) & (key_rows < N)
            exact = False  # the tile on int8 MMAs (INT8: its rows and keys all encoded exactly)
            if INT8:
                k_exact = tl.min(tl.load(kok_ptr + key_rows, mask=key_ok, other=1).to(tl.int32), 0)
                exact = (q_exact == 1) & (k_exact == 1)
            acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
            if exact:  # indexer_logits_int8's steps: the same bits
                k8 = tl.load(k8_ptr + key_rows[None, :].to(tl.int64) * D + d[:, None],
                             mask=key_ok[None, :], other=0)  # fmt: skip
                col_scale = tl.load(kscale_ptr + key_rows, mask=key_ok, other=1.0)
                acc = int8_heads(
                    acc, q8_ptr + rows64[:, None] * H * D + d[None, :], w2_ptr + rows64 * H, k8,
                    active, H, D, RNE, PACKED, CVT, RELU_FMA, STAGES,
                )  # fmt: skip
                acc = index_score(acc, QAT, RNE, PACKED) * col_scale[None, :]
            else:
                k_ptrs = k_ptr + key_rows[None, :].to(tl.int64) * stride_kn + d[:, None]
                kt = tl.load(k_ptrs, mask=key_ok[None, :], other=0.0)
                if UPCAST:
                    kt = kt.to(tl.float32)
                q_ptrs = q_ptr + rows64[:, None] * stride_qt + d[None, :]
                w_ptrs = w_ptr + rows64 * stride_wt
                acc = add_heads(
                    acc, q_ptrs, w_ptrs, kt, active, H, stride_qh, QAT, RNE,
                    PACKED, UPCAST, DOT_PREC, STAGES,
                )  # fmt: skip
                acc = index_score(acc, QAT, RNE, PACKED)
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
            key = sortable_key(acc)  # acc starts at +0.0 and adds products: never -0.0
            take = elig & (key > tau[:, None])
            take_i = take.to(tl.int32)  # the stores mask with take_i != 0, not take: Triton 3.6
            # (the device's) failed to compile this kernel (block max + qat) with mask=take
            n_take = tl.sum(take_i, 1)
            if tl.max(n_take, 0) > 0:
                # int32 offsets from each row's buffer: 64-bit addresses per element spilled
                at = cnt[:, None] + tl.cumsum(take_i, 1) - 1
                tl.store((sk_ptr + slots * CAP)[:, None] + at, key, mask=take_i != 0)
                tl.store(
                    (si_ptr + slots * CAP)[:, None] + at,
                    cols[None, :] + tl.zeros_like(key),
                    mask=take_i != 0,
                )
                cnt += n_take
                if tl.max(cnt, 0) > CAP - BLOCK_N:  # a buffer could overflow at the next tile
                    tl.store(cnt_ptr + slots, cnt, mask=row_ok)
                    cut_block(
                        sk_ptr, si_ptr, cnt_ptr, tau_ptr, first_row, T, piece, PIECES,
                        BLOCK_T, RG, CAP, K, KEY_BITS,
                    )  # fmt: skip
                    cnt = tl.load(cnt_ptr + slots, mask=row_ok, other=0)
                    # a row cut below K keeps all it has and the seed's floor
                    tau = tl.load(tau_ptr + slots, mask=row_ok, other=-2147483648)
                    tau = tl.maximum(tau, floor)
        done = tl.where(active, 1, done)
    tl.store(cnt_ptr + slots, cnt, mask=row_ok)
    if FINAL_CUT:  # else the merge takes the buffer as it is (its top K and the keys above τ)
        cut_block(
            sk_ptr, si_ptr, cnt_ptr, tau_ptr, first_row, T, piece, PIECES, BLOCK_T, RG, CAP, K,
            KEY_BITS,
        )  # fmt: skip
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
                if SEEDED:  # fewer than K keys reached the seed: the row needs the redo
                    tl.store(redo_ptr + r, ((n > K) & (c < K)).to(tl.int8), mask=r_ok)
            tl.store(
                out_ptr + r64[:, None] * stride_ot + o[None, :],
                sel,
                mask=r_ok[:, None] & (o < K)[None, :],
            )


@triton.jit
def member_kernel(ids_ptr, member_ptr, NB, MB, stride_it, MB_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, MB_PAD)
    ids = tl.load(ids_ptr + row * stride_it + j, mask=j < MB, other=-1)
    ok = (ids >= 0) & (ids < NB)
    tl.store(member_ptr + row * NB + ids, tl.full([MB_PAD], 1, tl.uint8), mask=ok)
