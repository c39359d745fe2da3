"""The running top-k buffer of the fused indexer kernels: cut a row's buffer to its exact top K.

Each row keeps its running selection in a small buffer of CAP (order-preserving int32 key, column)
pairs in column order (`kernels.topk_common.sortable_key` makes the keys). A column enters when
its key beats the row's threshold τ, the K-th largest key seen so far (INT_MIN until the row has
seen K).
When a buffer is nearly full it is cut to exactly its top K by (key desc, column asc): a bitwise
search over the keys (`kth_rows`, vectorised over rows; `kernels/topk.py` runs it on one row for its
selections and the pieces' merge), then a stable compaction (`cut_rows`); τ rises. A later column
enters only if its key is > τ: on a tie it loses to the K buffered keys, which all have smaller
columns. After the last column the buffer is the exact top K in the total order of
`ops.indexer._pick_topk` (value, then the smaller index).

KEY_BITS: how many high key bits the search walks. 32 always works. With 16, every key must be
the sortable image of a bf16 value (the `qat` index scores, rounded to bf16): its low 16 bits
are then 0 for a positive value and all ones for a negative one, a function of the high 16
(which hold the sign), so 16 steps find the K-th key's high half and one more step its low half
— 17 counts over the buffer instead of 32.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _raise_if_k(keys, tau_u, step, K: tl.constexpr):
    """tau_u + step where at least K keys of the row are ≥ it (unsigned images), else tau_u."""
    cand_u = tau_u + step
    cand = (cand_u - 2147483648).to(tl.int32)
    cnt = tl.sum((keys >= cand[:, None]).to(tl.int32), 1)
    return tl.where(cnt >= K, cand_u, tau_u)


@triton.jit
def kth_rows(keys, R: tl.constexpr, K: tl.constexpr, KEY_BITS: tl.constexpr):
    """Per row of `keys` [R, C] (int32; INT_MIN pads never counted): its K-th largest key, or
    INT_MIN when the row has fewer than K keys."""
    tau_u = tl.zeros([R], dtype=tl.int64)  # built bit by bit in the unsigned image key + 2^31
    one = tl.full([R], 1, tl.int64)
    for i in range(KEY_BITS):
        tau_u = _raise_if_k(keys, tau_u, one << (31 - i), K)
    if KEY_BITS < 32:  # the low bits: all zero or all ones (see the module docstring)
        tau_u = _raise_if_k(keys, tau_u, (one << (32 - KEY_BITS)) - 1, K)
    return (tau_u - 2147483648).to(tl.int32)


@triton.jit
def cut_rows(
    sk_ptr, si_ptr, cnt_ptr, tau_ptr, slots, ok,
    R: tl.constexpr, CAP: tl.constexpr, K: tl.constexpr, KEY_BITS: tl.constexpr,
):  # fmt: skip
    """Cut the buffers of `slots` [R] to their top K (stable) and publish count and τ."""
    j = tl.arange(0, CAP)
    c = tl.load(cnt_ptr + slots, mask=ok, other=0)
    live = j[None, :] < c[:, None]
    at = slots[:, None] * CAP + j[None, :]
    keys = tl.load(sk_ptr + at, mask=live, other=-2147483648)
    idx = tl.load(si_ptr + at, mask=live, other=0)
    tau = kth_rows(keys, R, K, KEY_BITS)
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
def cut_block(
    sk_ptr, si_ptr, cnt_ptr, tau_ptr, first_row, T, piece, PIECES,
    BLOCK_T: tl.constexpr, RG: tl.constexpr, CAP: tl.constexpr, K: tl.constexpr,
    KEY_BITS: tl.constexpr,
):  # fmt: skip
    """Cut every row buffer of the row block, RG rows at a time."""
    tl.debug_barrier()  # the appended pairs and counts are visible to every thread
    for g in range(0, BLOCK_T, RG):
        r = first_row + g + tl.arange(0, RG)
        slots = r.to(tl.int64) * PIECES + piece
        cut_rows(sk_ptr, si_ptr, cnt_ptr, tau_ptr, slots, r < T, RG, CAP, K, KEY_BITS)
    tl.debug_barrier()
