"""The jit helpers `kernels/topk.py`'s slots merge and `kernels/topk_stream.py`'s stream merge
share: the order-preserving int32 keys, the k-th key searches (in registers and from memory) and
the writes of a selection."""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4cp.kernels.running_topk import kth_rows


@triton.jit
def sortable_key(x):
    # fp32 → int32 with the same order: negative floats get their magnitude bits flipped.
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def load_keys(row_ptr, cols, n):
    key = sortable_key(tl.load(row_ptr + cols, mask=cols < n, other=0.0).to(tl.float32))
    key = tl.where(key == -1, 0, key)  # −0's key is −1: −0 ties +0, as in the twin
    return tl.where(cols < n, key, -2147483648)


@triton.jit
def kth_key(keys, K: tl.constexpr, KEY_BITS: tl.constexpr):
    """The K-th largest of `keys` [C] (int32; pads are INT_MIN and never counted): the running
    top-k's search (`running_topk.kth_rows`, KEY_BITS as there) over one row."""
    return tl.max(kth_rows(tl.reshape(keys, [1, keys.shape[0]]), 1, K, KEY_BITS), 0)


@triton.jit
def store_selection(keys, idx, ok, tau, out_row, K: tl.constexpr):
    """Write idx of keys > τ and of the first (K − #greater) keys == τ, in order."""
    gt = keys > tau
    eq = (keys == tau) & ok
    need = K - tl.sum(gt.to(tl.int32), 0)
    sel = gt | (eq & (tl.cumsum(eq.to(tl.int32), 0) <= need))
    pos = tl.cumsum(sel.to(tl.int32), 0) - 1
    tl.store(out_row + pos, idx, mask=sel)


@triton.jit
def write_streamed(
    row_ptr, start, end, tau, need, dst_i, dst_k, STORE_KEYS: tl.constexpr, SUB: tl.constexpr,
    ALL_TIES: tl.constexpr = False,
):  # fmt: skip
    """The selection among keys [start, end) of the row in memory (those > τ and the first
    `need` == τ), SUB at a time: positions at dst_i, in order (keys at dst_k too when
    STORE_KEYS). A kernel that searched the row in registers writes this way to keep only SUB
    of them live (the whole row's running sums would double its registers). ALL_TIES: the
    caller knows every key == τ is selected (exactly K are ≥ τ), so the keys ≥ τ are, by one
    prefix sum instead of two."""
    cols = tl.arange(0, SUB)
    eq_before = tl.zeros([], dtype=tl.int32)
    sel_before = tl.zeros([], dtype=tl.int32)
    for c0 in range(start, end, SUB):
        cc = c0 + cols
        kc = load_keys(row_ptr, cc, end)
        if ALL_TIES:
            sel = kc >= tau  # pads are INT_MIN, below every τ
        else:
            eq = (kc == tau) & (cc < end)
            sel = (kc > tau) | (eq & (eq_before + tl.cumsum(eq.to(tl.int32), 0) <= need))
            eq_before += tl.sum(eq.to(tl.int32), 0)
        pos = sel_before + tl.cumsum(sel.to(tl.int32), 0) - 1
        tl.store(dst_i + pos, cc, mask=sel)
        if STORE_KEYS:
            tl.store(dst_k + pos, kc, mask=sel)
        sel_before += tl.sum(sel.to(tl.int32), 0)


@triton.jit
def _stream_raise(row_ptr, n, tau_u, step, K: tl.constexpr, BLOCK: tl.constexpr):
    """tau_u + step where at least K keys of the row are ≥ it (unsigned images), else tau_u:
    one counting pass over the row in memory."""
    cols = tl.arange(0, BLOCK)
    cand_u = tau_u + step
    cand = (cand_u - 2147483648).to(tl.int32)
    cnt = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, n, BLOCK):
        cnt += tl.sum((load_keys(row_ptr, c0 + cols, n) >= cand).to(tl.int32), 0)
    return tl.where(cnt >= K, cand_u, tau_u)


@triton.jit
def stream_kth(row_ptr, n, K: tl.constexpr, BLOCK: tl.constexpr, KEY_BITS: tl.constexpr):
    """The K-th largest of the row's n keys in memory and how many are greater: KEY_BITS (+1
    below 32) counting passes (`kth_rows`' search) and one more."""
    tau_u = tl.zeros([], dtype=tl.int64)
    one = tl.full([], 1, tl.int64)
    for i in range(KEY_BITS):
        tau_u = _stream_raise(row_ptr, n, tau_u, one << (31 - i), K, BLOCK)
    if KEY_BITS < 32:  # the low bits: all zero or all ones (running_topk's module docstring)
        tau_u = _stream_raise(row_ptr, n, tau_u, (one << (32 - KEY_BITS)) - 1, K, BLOCK)
    tau = (tau_u - 2147483648).to(tl.int32)
    cols = tl.arange(0, BLOCK)
    n_gt = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, n, BLOCK):
        n_gt += tl.sum((load_keys(row_ptr, c0 + cols, n) > tau).to(tl.int32), 0)
    return tau, n_gt


@triton.jit
def row_count(nvis_ptr, row, W):
    return tl.maximum(tl.minimum(tl.load(nvis_ptr + row).to(tl.int32), W), 0)


@triton.jit
def store_prefix(out_row, n, K: tl.constexpr, OUT_BLOCK: tl.constexpr):
    o = tl.arange(0, OUT_BLOCK)
    tl.store(out_row + o, tl.where(o < n, o, -1), mask=o < K)


def piece_warps(block: int) -> int:
    return max(4, min(8, block // 2048))
