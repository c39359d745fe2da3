"""Exact per-row top-k indices by threshold search (attention-math §4.5, §5.3).

fp32 logits map to order-preserving int32 keys; a 32-step bitwise search finds the k-th largest
key τ (each step counts keys ≥ a candidate; `key_bits=16`: 17 steps, for logits that are all
bf16 values, as qat's index scores are — `running_topk`'s module docstring says why); the
output is every key > τ plus the first (k − #greater) keys == τ in index order, so ties resolve
to the lowest indices (as the ops twin does). Positions come from a prefix sum over the
selection mask, which leaves the output sorted ascending with no sort. Rows with n ≤ k write
0..n-1 and -1 pads without a search.

Rows up to MAX_SINGLE wide: one program per row, the row in registers for every step.
Wider rows, two levels: (1) one program per CHUNK-wide piece finds that piece's k-th largest key,
and the largest of those is a lower bound of the row's k-th largest (that piece alone holds k
keys ≥ it); (2) one program per row compacts the keys ≥ the bound (at most pieces·k plus ties,
in index order) and selects among them in registers. A row whose candidates overflow the buffer
(heavy ties) falls back to searching the whole row from memory (a pass per step, one more).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv4cp.kernels.running_topk import kth_rows

MAX_K = 4096
MAX_SINGLE = 16384
CHUNK = 16384  # first-level piece: in registers like a single row
STREAM = 4096  # chunk width of the streaming passes
MAX_CAP = 16384


@triton.jit
def _sortable(x):
    # fp32 → int32 with the same order: negative floats get their magnitude bits flipped.
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _load_keys(row_ptr, cols, n):
    x = tl.load(row_ptr + cols, mask=cols < n, other=0.0)
    return tl.where(cols < n, _sortable(x), -2147483648)


@triton.jit
def _kth_key(keys, K: tl.constexpr, KEY_BITS: tl.constexpr):
    """The K-th largest of `keys` [C] (int32; pads are INT_MIN and never counted): the running
    top-k's search (`running_topk.kth_rows`, KEY_BITS as there) over one row."""
    return tl.max(kth_rows(tl.reshape(keys, [1, keys.shape[0]]), 1, K, KEY_BITS), 0)


@triton.jit
def _store_selection(keys, idx, ok, tau, out_row, K: tl.constexpr):
    """Write idx of keys > τ and of the first (K − #greater) keys == τ, in order."""
    gt = keys > tau
    eq = (keys == tau) & ok
    need = K - tl.sum(gt.to(tl.int32), 0)
    sel = gt | (eq & (tl.cumsum(eq.to(tl.int32), 0) <= need))
    pos = tl.cumsum(sel.to(tl.int32), 0) - 1
    tl.store(out_row + pos, idx, mask=sel)


@triton.jit
def _stream_raise(row_ptr, n, tau_u, step, K: tl.constexpr, BLOCK: tl.constexpr):
    """tau_u + step where at least K keys of the row are ≥ it (unsigned images), else tau_u:
    one counting pass over the row in memory."""
    cols = tl.arange(0, BLOCK)
    cand_u = tau_u + step
    cand = (cand_u - 2147483648).to(tl.int32)
    cnt = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, n, BLOCK):
        cnt += tl.sum((_load_keys(row_ptr, c0 + cols, n) >= cand).to(tl.int32), 0)
    return tl.where(cnt >= K, cand_u, tau_u)


@triton.jit
def _stream_select(
    row_ptr, out_row, n, K: tl.constexpr, BLOCK: tl.constexpr, KEY_BITS: tl.constexpr
):
    """Whole-row search from memory: KEY_BITS (+1 below 32) counting passes (`kth_rows`' search),
    one counting pass, one writing pass."""
    cols = tl.arange(0, BLOCK)
    tau_u = tl.zeros([], dtype=tl.int64)
    one = tl.full([], 1, tl.int64)
    for i in range(KEY_BITS):
        tau_u = _stream_raise(row_ptr, n, tau_u, one << (31 - i), K, BLOCK)
    if KEY_BITS < 32:  # the low bits: all zero or all ones (running_topk's module docstring)
        tau_u = _stream_raise(row_ptr, n, tau_u, (one << (32 - KEY_BITS)) - 1, K, BLOCK)
    tau = (tau_u - 2147483648).to(tl.int32)
    n_gt = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, n, BLOCK):
        n_gt += tl.sum((_load_keys(row_ptr, c0 + cols, n) > tau).to(tl.int32), 0)
    need = K - n_gt
    eq_before = tl.zeros([], dtype=tl.int32)
    sel_before = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, n, BLOCK):
        cc = c0 + cols
        kc = _load_keys(row_ptr, cc, n)
        gt = kc > tau
        eq = (kc == tau) & (cc < n)
        sel = gt | (eq & (eq_before + tl.cumsum(eq.to(tl.int32), 0) <= need))
        pos = sel_before + tl.cumsum(sel.to(tl.int32), 0) - 1
        tl.store(out_row + pos, cc, mask=sel)
        eq_before += tl.sum(eq.to(tl.int32), 0)
        sel_before += tl.sum(sel.to(tl.int32), 0)


@triton.jit
def _row_n(nvis_ptr, row, W):
    return tl.maximum(tl.minimum(tl.load(nvis_ptr + row).to(tl.int32), W), 0)


@triton.jit
def _store_prefix(out_row, n, K: tl.constexpr, OUT_BLOCK: tl.constexpr):
    o = tl.arange(0, OUT_BLOCK)
    tl.store(out_row + o, tl.where(o < n, o, -1), mask=o < K)


@triton.jit
def _topk_row_kernel(
    logits_ptr,
    nvis_ptr,
    out_ptr,
    W,
    stride_lt,
    stride_ot,
    K: tl.constexpr,
    OUT_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    KEY_BITS: tl.constexpr,
    NARROW: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n = _row_n(nvis_ptr, row, W)
    out_row = out_ptr + row * stride_ot
    if NARROW > 0 and n > NARROW:
        pass  # a wide row: the two levels' kernels select it
    elif n <= K:
        _store_prefix(out_row, n, K, OUT_BLOCK)
    else:
        cols = tl.arange(0, BLOCK)
        keys = _load_keys(logits_ptr + row * stride_lt, cols, n)
        _store_selection(keys, cols, cols < n, _kth_key(keys, K, KEY_BITS), out_row, K)


@triton.jit
def _piece_kth_kernel(
    logits_ptr,
    nvis_ptr,
    thr_ptr,
    W,
    stride_lt,
    PIECES,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    KEY_BITS: tl.constexpr,
    NARROW: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1)
    n = _row_n(nvis_ptr, row, W)
    start = piece * BLOCK
    tau = tl.full([], -2147483648, tl.int32)  # a piece with ≤ K keys bounds nothing
    if tl.minimum(n - start, BLOCK) > K and n > NARROW:  # narrow rows: the row kernel's
        keys = _load_keys(logits_ptr + row * stride_lt, start + tl.arange(0, BLOCK), n)
        tau = _kth_key(keys, K, KEY_BITS)
    tl.store(thr_ptr + row * PIECES + piece, tau)


@triton.jit
def _topk_candidates_kernel(
    logits_ptr,
    nvis_ptr,
    thr_ptr,
    ck_ptr,
    ci_ptr,
    out_ptr,
    W,
    stride_lt,
    stride_ot,
    PIECES,
    K: tl.constexpr,
    OUT_BLOCK: tl.constexpr,
    P_BLOCK: tl.constexpr,
    STREAM_BLOCK: tl.constexpr,
    CAP: tl.constexpr,
    KEY_BITS: tl.constexpr,
    NARROW: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n = _row_n(nvis_ptr, row, W)
    row_ptr = logits_ptr + row * stride_lt
    out_row = out_ptr + row * stride_ot
    if NARROW > 0 and n <= NARROW:
        pass  # a narrow row: the row kernel selected it
    elif n <= K:
        _store_prefix(out_row, n, K, OUT_BLOCK)
    else:
        p = tl.arange(0, P_BLOCK)
        thr = tl.load(thr_ptr + row * PIECES + p, mask=p < PIECES, other=-2147483648)
        bound = tl.max(thr, 0)
        cols = tl.arange(0, STREAM_BLOCK)
        ck_row = ck_ptr + row * CAP
        ci_row = ci_ptr + row * CAP
        cnt = tl.zeros([], dtype=tl.int32)
        for c0 in range(0, n, STREAM_BLOCK):
            cc = c0 + cols
            kc = _load_keys(row_ptr, cc, n)
            keep = kc >= bound
            pos = cnt + tl.cumsum(keep.to(tl.int32), 0) - 1
            tl.store(ck_row + pos, kc, mask=keep & (pos < CAP))
            tl.store(ci_row + pos, cc, mask=keep & (pos < CAP))
            cnt += tl.sum(keep.to(tl.int32), 0)
        if cnt <= CAP:
            tl.debug_barrier()  # the compacted candidates are read back by other threads
            j = tl.arange(0, CAP)
            keys = tl.load(ck_row + j, mask=j < cnt, other=-2147483648)
            idx = tl.load(ci_row + j, mask=j < cnt, other=0)
            _store_selection(keys, idx, j < cnt, _kth_key(keys, K, KEY_BITS), out_row, K)
        else:
            _stream_select(row_ptr, out_row, n, K, STREAM_BLOCK, KEY_BITS)


def check_topk(logits: Tensor, n_visible: Tensor, k: int) -> None:
    """Raise ValueError naming the limit when the kernel cannot take these shapes."""
    if logits.dim() != 2:
        raise ValueError(f"topk_indices: logits must be [T, W], got {tuple(logits.shape)}")
    if logits.dtype != torch.float32:
        raise ValueError(f"topk_indices kernel: logits must be fp32, got {logits.dtype}")
    if not 1 <= k <= MAX_K:
        raise ValueError(f"topk_indices kernel: k must be in [1, {MAX_K}], got {k}")
    if n_visible.shape != (logits.shape[0],):
        raise ValueError(
            f"topk_indices: n_visible must be [{logits.shape[0]}], got {tuple(n_visible.shape)}"
        )


def _warps(block: int) -> int:
    return max(4, min(8, block // 2048))


def _launch_rows(
    logits: Tensor, n_visible: Tensor, out: Tensor, w: int, key_bits: int, width: int, narrow: int
) -> None:
    """The row kernel over rows of up to `width` keys in registers (`narrow` > 0: only the rows
    with ≤ narrow visible keys)."""
    block = max(16, triton.next_power_of_2(width))
    _topk_row_kernel[(logits.shape[0],)](
        logits,
        n_visible,
        out,
        w,
        logits.stride(0),
        out.stride(0),
        K=out.shape[1],
        OUT_BLOCK=triton.next_power_of_2(out.shape[1]),
        BLOCK=block,
        KEY_BITS=key_bits,
        NARROW=narrow,
        num_warps=_warps(block),
    )


def topk_indices(logits: Tensor, n_visible: Tensor, k: int) -> Tensor:
    """Triton twin of ops.indexer.topk_indices: int32 [T, k], sorted ascending, -1 pads."""
    return launch_topk(logits, n_visible, k)


def launch_topk(
    logits: Tensor,
    n_visible: Tensor,
    k: int,
    *,
    piece: int | None = None,
    stream: int = STREAM,
    cap: int | None = None,
    key_bits: int = 32,
    split: int = 0,
    cand_warps: int | None = None,
) -> Tensor:
    """topk_indices with the two-level sizes overridable: `piece`, `stream` and `cap` (tests
    use them to reach that path, and its overflow fallback, at small widths; benchmarks sweep
    `piece`). `key_bits=16` is for logits that are all bf16 values (qat's index scores, block
    maxima of them, ±inf): the search walks their keys' 16 high bits and one step for the low
    ones, the same selection in 17 counting steps instead of 32. Other logits need 32 (16 would
    misplace τ: the caller vouches for the values, they are not checked).
    `split` (in [0, MAX_SINGLE]; 0, the default, is off: not yet timed, docs/performance.md
    §37): on the two levels' path, the rows with at most `split` visible keys are selected in
    registers by the row kernel instead (a cold prefill's early rows are narrow). `cand_warps`:
    the candidates kernel's warps (a power of two ≤ 32; default by `cap`)."""
    check_topk(logits, n_visible, k)
    if key_bits not in (16, 32):
        raise ValueError(f"topk_indices kernel: key_bits must be 16 or 32, got {key_bits}")
    t, w = logits.shape
    out = torch.empty((t, k), dtype=torch.int32, device=logits.device)  # every slot is written
    if t == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    n_visible = n_visible.contiguous()
    out_block = triton.next_power_of_2(k)
    if not 0 <= split <= MAX_SINGLE:
        raise ValueError(f"topk_indices kernel: split must be in [0, {MAX_SINGLE}], got {split}")
    if cand_warps is not None and cand_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(
            f"topk_indices kernel: cand_warps must be a power of two ≤ 32, got {cand_warps}"
        )
    if piece is None and w <= MAX_SINGLE:
        _launch_rows(logits, n_visible, out, w, key_bits, w, 0)
        return out
    if split:
        _launch_rows(logits, n_visible, out, w, key_bits, split, split)
    piece = piece or CHUNK
    pieces = triton.cdiv(w, piece)
    # pieces·k bounds the candidates up to ties at the bound (bf16-valued scores tie often): 2x.
    cap = cap or min(MAX_CAP, max(16, 2 * triton.next_power_of_2(pieces * k)))
    thr = torch.empty((t, pieces), dtype=torch.int32, device=logits.device)
    _piece_kth_kernel[(t, pieces)](
        logits,
        n_visible,
        thr,
        w,
        logits.stride(0),
        pieces,
        K=k,
        BLOCK=piece,
        KEY_BITS=key_bits,
        NARROW=split,
        num_warps=_warps(piece),
    )
    ck = torch.empty((t, cap), dtype=torch.int32, device=logits.device)
    ci = torch.empty((t, cap), dtype=torch.int32, device=logits.device)
    _topk_candidates_kernel[(t,)](
        logits,
        n_visible,
        thr,
        ck,
        ci,
        out,
        w,
        logits.stride(0),
        out.stride(0),
        pieces,
        K=k,
        OUT_BLOCK=out_block,
        P_BLOCK=max(16, triton.next_power_of_2(pieces)),
        STREAM_BLOCK=stream,
        CAP=cap,
        KEY_BITS=key_bits,
        NARROW=split,
        num_warps=cand_warps or max(4, min(16, cap // 1024)),
    )
    return out
