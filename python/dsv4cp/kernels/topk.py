"""Exact per-row top-k indices by threshold search (attention-math §4.5, §5.3).

fp32 (or bf16) logits map to order-preserving int32 keys (−0 ties +0, as in the twin); a
32-step bitwise search finds the k-th largest key τ (each step counts keys ≥ a candidate;
`key_bits=16`: 17 steps, for logits that are all bf16 values, as qat's index scores are —
`running_topk`'s module docstring says why — and the slots merge's pieces then search 16 steps
over bf16 pairs, `topk_bf16x2`, two keys per compare); the output is every key > τ plus the
first (k − #greater) keys == τ in index order, so ties resolve to the lowest indices (as the ops
twin does). Positions come from a prefix sum over the selection mask, which leaves the output
sorted ascending with no sort. Rows with n ≤ k write 0..n-1 and -1 pads without a search.

Two levels. The default (`merge="slots"`): (1) one program per piece (`slot_piece`: 8192 keys, 4096
for rows up to 16K wide in the int32 keys' search, or 16384 where 8192's slots would not fit the
merge) selects that piece's own top k, the piece in registers for the search (a piece holding a NaN:
the bf16-pair search hands it to the search from memory) and the selection written from memory SUB
keys at a time (`_write_streamed`, which keeps the kernel at half the registers of an in-register
prefix sum), and writes those ≤ k keys and indices to the piece's slot; a row that is one piece is
selected there outright. (2) one program per row selects among its pieces' slots, read piece by
piece (so in index order). That is exact: the row's k-th largest key τ is ≥ every piece's, so each
selected key > τ is above its piece's k-th too, and when τ is a piece's own k-th, the row's first
ties in index order are that piece's first ties (fewer keys above τ in the piece than in the row
leaves the piece more room for ties).
Rows whose pieces' slots exceed MAX_MERGE keys (pieces × k) take `merge="stream"`: one program
per 16K piece finds its k-th key, the largest of those bounds the row's k-th from below; one
program per row compacts the keys ≥ it from memory (at most pieces·k plus ties, in index order)
and selects among them. A row whose candidates overflow that buffer (heavy ties) is searched
whole from memory (a pass per step, one more).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv4cp.kernels._triton import interpreting
from dsv4cp.kernels.running_topk import kth_rows
from dsv4cp.kernels.topk_bf16x2 import kth_bf16x2

MAX_K = 4096
CHUNK = 16384  # merge="stream"'s piece, in registers
STREAM = 4096  # chunk width of the streaming passes
MAX_CAP = 16384
WRITE_SUB = 2048  # keys at a time of a selection written from memory (`_write_streamed`)
MAX_MERGE = 16384  # slots (pieces × k, padded to powers of two) one merge program holds
SLOT_PIECES = (4096, 8192, 16384)  # merge="slots"' piece widths, narrowest first


@triton.jit
def _sortable(x):
    # fp32 → int32 with the same order: negative floats get their magnitude bits flipped.
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _load_keys(row_ptr, cols, n):
    key = _sortable(tl.load(row_ptr + cols, mask=cols < n, other=0.0).to(tl.float32))
    key = tl.where(key == -1, 0, key)  # −0's key is −1: −0 ties +0, as in the twin
    return tl.where(cols < n, key, -2147483648)


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
def _write_streamed(
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
        kc = _load_keys(row_ptr, cc, end)
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
        cnt += tl.sum((_load_keys(row_ptr, c0 + cols, n) >= cand).to(tl.int32), 0)
    return tl.where(cnt >= K, cand_u, tau_u)


@triton.jit
def _stream_kth(row_ptr, n, K: tl.constexpr, BLOCK: tl.constexpr, KEY_BITS: tl.constexpr):
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
        n_gt += tl.sum((_load_keys(row_ptr, c0 + cols, n) > tau).to(tl.int32), 0)
    return tau, n_gt


@triton.jit
def _stream_select(
    row_ptr, out_row, n, K: tl.constexpr, BLOCK: tl.constexpr, KEY_BITS: tl.constexpr
):
    """Whole-row search from memory (`_stream_kth`), then one writing pass."""
    tau, n_gt = _stream_kth(row_ptr, n, K, BLOCK, KEY_BITS)
    _write_streamed(row_ptr, 0, n, tau, K - n_gt, out_row, out_row, False, BLOCK)


@triton.jit
def _row_n(nvis_ptr, row, W):
    return tl.maximum(tl.minimum(tl.load(nvis_ptr + row).to(tl.int32), W), 0)


@triton.jit
def _store_prefix(out_row, n, K: tl.constexpr, OUT_BLOCK: tl.constexpr):
    o = tl.arange(0, OUT_BLOCK)
    tl.store(out_row + o, tl.where(o < n, o, -1), mask=o < K)


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
):
    row = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1)
    n = _row_n(nvis_ptr, row, W)
    start = piece * BLOCK
    tau = tl.full([], -2147483648, tl.int32)  # a piece with ≤ K keys bounds nothing
    if tl.minimum(n - start, BLOCK) > K:
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
):
    row = tl.program_id(0).to(tl.int64)
    n = _row_n(nvis_ptr, row, W)
    row_ptr = logits_ptr + row * stride_lt
    out_row = out_ptr + row * stride_ot
    if n <= K:
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


@triton.jit
def _select_piece(
    row_ptr, start, m, dst_i, dst_k, STORE_KEYS: tl.constexpr, K: tl.constexpr,
    BLOCK: tl.constexpr, SUB: tl.constexpr, KEY_BITS: tl.constexpr, PACKED: tl.constexpr,
    EMULATE: tl.constexpr,
):  # fmt: skip
    """The top K of keys [start, start + m) of the row (m > K): searched in registers (PACKED:
    as bf16 pairs, `topk_bf16x2`), indices written in order at dst_i (keys at dst_k too when
    STORE_KEYS) from memory, SUB at a time."""
    end = start + m
    all_ties = False
    if PACKED:
        tau_x, n_gt, n_ge, ok = kth_bf16x2(row_ptr, start, end, K, BLOCK, EMULATE)
        tau = _sortable(tau_x)  # τ's key, as _load_keys makes the keys
        all_ties = ok and n_ge == K  # no key == τ left out
        if not ok:
            tau, n_gt = _stream_kth(row_ptr + start, m, K, SUB, KEY_BITS)  # from memory
    else:
        keys = _load_keys(row_ptr, start + tl.arange(0, BLOCK), end)
        tau = _kth_key(keys, K, KEY_BITS)
        n_gt = tl.sum((keys > tau).to(tl.int32), 0)
    if all_ties:  # the keys ≥ τ: one prefix sum
        _write_streamed(row_ptr, start, end, tau, 0, dst_i, dst_k, STORE_KEYS, SUB, True)
    else:
        _write_streamed(row_ptr, start, end, tau, K - n_gt, dst_i, dst_k, STORE_KEYS, SUB)


@triton.jit
def _piece_select_kernel(
    logits_ptr,
    nvis_ptr,
    sk_ptr,
    si_ptr,
    out_ptr,
    W,
    stride_lt,
    stride_ot,
    PIECES,
    K: tl.constexpr,
    OUT_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    SUB: tl.constexpr,
    KEY_BITS: tl.constexpr,
    PACKED: tl.constexpr,
    EMULATE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1)
    n = _row_n(nvis_ptr, row, W)
    row_ptr = logits_ptr + row * stride_lt
    start = piece * BLOCK
    if n <= BLOCK:  # the row is its first piece: selected here, the merge skips it
        if piece == 0:
            out_row = out_ptr + row * stride_ot
            if n <= K:
                _store_prefix(out_row, n, K, OUT_BLOCK)
            else:
                _select_piece(
                    row_ptr,
                    0,
                    n,
                    out_row,
                    out_row,
                    False,
                    K,
                    BLOCK,
                    SUB,
                    KEY_BITS,
                    PACKED,
                    EMULATE,
                )
    else:
        slot = (row * PIECES + piece) * K
        m = tl.minimum(n - start, BLOCK)
        if m > K:  # the piece's own top K, in index order
            _select_piece(
                row_ptr, start, m, si_ptr + slot, sk_ptr + slot, True, K, BLOCK, SUB, KEY_BITS,
                PACKED, EMULATE,
            )  # fmt: skip
        elif m > 0:  # all of its keys
            o = tl.arange(0, OUT_BLOCK)
            tl.store(sk_ptr + slot + o, _load_keys(row_ptr, start + o, n), mask=o < m)
            tl.store(si_ptr + slot + o, start + o, mask=o < m)


@triton.jit
def _topk_merge_kernel(
    sk_ptr,
    si_ptr,
    nvis_ptr,
    out_ptr,
    W,
    stride_ot,
    PIECES,
    PIECE,
    K: tl.constexpr,
    OUT_BLOCK: tl.constexpr,
    M_BLOCK: tl.constexpr,
    KEY_BITS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n = _row_n(nvis_ptr, row, W)
    out_row = out_ptr + row * stride_ot
    if n > PIECE:  # narrower rows: the piece kernel selected them
        if n <= K:
            _store_prefix(out_row, n, K, OUT_BLOCK)
        else:
            j = tl.arange(0, M_BLOCK)
            p = j // OUT_BLOCK
            s = j % OUT_BLOCK
            filled = tl.minimum(tl.minimum(tl.maximum(n - p * PIECE, 0), PIECE), K)
            ok = (p < PIECES) & (s < filled)
            off = (row * PIECES + p) * K + s
            keys = tl.load(sk_ptr + off, mask=ok, other=-2147483648)
            idx = tl.load(si_ptr + off, mask=ok, other=0)
            _store_selection(keys, idx, ok, _kth_key(keys, K, KEY_BITS), out_row, K)


def check_topk(logits: Tensor, n_visible: Tensor, k: int) -> None:
    """Raise ValueError naming the limit when the kernel cannot take these shapes."""
    if logits.dim() != 2:
        raise ValueError(f"topk_indices: logits must be [T, W], got {tuple(logits.shape)}")
    if logits.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"topk_indices kernel: logits must be fp32 or bf16, got {logits.dtype}")
    if not 1 <= k <= MAX_K:
        raise ValueError(f"topk_indices kernel: k must be in [1, {MAX_K}], got {k}")
    if n_visible.shape != (logits.shape[0],):
        raise ValueError(
            f"topk_indices: n_visible must be [{logits.shape[0]}], got {tuple(n_visible.shape)}"
        )


def _warps(block: int) -> int:
    return max(4, min(8, block // 2048))


def slot_piece(w: int, k: int, packed: bool = False) -> int | None:
    """merge="slots"' piece width for rows `w` wide at top `k` (measured, docs/performance.md
    §38–§39: 8192; 4096 up to 16K keys for the int32 keys' search, `packed` False), widened
    while the merge's pieces × k slots would not fit MAX_MERGE; None where no width fits
    (merge="stream" then)."""
    out_block = triton.next_power_of_2(k)
    for piece in SLOT_PIECES[0 if w <= 16384 and not packed else 1 :]:
        piece = min(piece, max(16, triton.next_power_of_2(w)))
        if _merge_block(w, piece, out_block) <= MAX_MERGE:
            return piece
    return None


def _merge_block(w: int, piece: int, out_block: int) -> int:
    return max(16, triton.next_power_of_2(triton.cdiv(w, piece)) * out_block)


def topk_indices(logits: Tensor, n_visible: Tensor, k: int) -> Tensor:
    """Triton twin of ops.indexer.topk_indices: int32 [T, k], sorted ascending, -1 pads."""
    return launch_topk(logits, n_visible, k)


def launch_topk(
    logits: Tensor,
    n_visible: Tensor,
    k: int,
    *,
    piece: int | None = None,
    merge: str | None = None,
    stream: int = STREAM,
    cap: int | None = None,
    key_bits: int = 32,
    packed: bool | None = None,
) -> Tensor:
    """topk_indices with the two levels overridable: `merge` ("slots" or "stream"; default
    slots where `slot_piece` finds a width) and `piece` (a power of two; tests use it to reach
    several pieces at small widths, benchmarks sweep it). `key_bits=16` is for logits that are
    all bf16 values (qat's index scores, block maxima of them, ±inf): the search walks their
    keys' 16 high bits and one step for the low ones, the same selection in 17 counting steps
    instead of 32. Other logits need 32 (16 would misplace τ: the caller vouches for the values,
    they are not checked). `packed` (default: key_bits == 16; merge="slots"): the pieces'
    search over bf16 pairs (`topk_bf16x2`), the same selection. `stream` and `cap`,
    merge="stream" only: its chunk and candidate buffer (a small cap reaches its overflow
    fallback)."""
    check_topk(logits, n_visible, k)
    if key_bits not in (16, 32):
        raise ValueError(f"topk_indices kernel: key_bits must be 16 or 32, got {key_bits}")
    if piece is not None and (piece < 1 or piece & (piece - 1)):
        raise ValueError(f"topk_indices kernel: piece must be a power of two, got {piece}")
    if packed and key_bits != 16:
        raise ValueError("topk_indices kernel: packed needs key_bits=16 (bf16-valued logits)")
    if merge not in (None, "slots", "stream"):
        raise ValueError(f"topk_indices kernel: merge must be 'slots' or 'stream', got {merge!r}")
    t, w = logits.shape
    out_block = triton.next_power_of_2(k)
    packed = key_bits == 16 and packed is not False
    slots = None  # the slots merge's piece width
    if merge != "stream":
        slots = piece or slot_piece(w, k, packed)
        if slots is not None and _merge_block(w, slots, out_block) > MAX_MERGE:
            slots = None
        if merge == "slots" and slots is None:
            raise ValueError(
                f"topk_indices kernel: merge='slots' cannot hold {w} keys' pieces × k={k} slots "
                f"in {MAX_MERGE}; use merge='stream'"
            )
        merge = "stream" if slots is None else "slots"
    if merge == "slots" and (stream != STREAM or cap is not None):
        raise ValueError("topk_indices kernel: stream and cap apply to merge='stream' only")
    out = torch.empty((t, k), dtype=torch.int32, device=logits.device)  # every slot is written
    if t == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    n_visible = n_visible.contiguous()
    if slots is not None:
        _launch_slots(logits, n_visible, out, key_bits, slots, packed)
    else:
        _launch_stream(logits, n_visible, out, key_bits, piece or CHUNK, stream, cap)
    return out


def _launch_slots(
    logits: Tensor, n_visible: Tensor, out: Tensor, key_bits: int, piece: int, packed: bool
) -> None:
    """merge='slots': each piece's own top k into its slot, then each row's selection among
    its slots."""
    (t, w), k = logits.shape, out.shape[1]
    out_block = triton.next_power_of_2(k)
    pieces = triton.cdiv(w, piece)
    if pieces == 1:  # every row is its own first piece: no slots, no merge
        sk = si = out
    else:
        sk = torch.empty((t, pieces, k), dtype=torch.int32, device=logits.device)
        si = torch.empty((t, pieces, k), dtype=torch.int32, device=logits.device)
    _piece_select_kernel[(t, pieces)](
        logits,
        n_visible,
        sk,
        si,
        out,
        w,
        logits.stride(0),
        out.stride(0),
        pieces,
        K=k,
        OUT_BLOCK=out_block,
        BLOCK=piece,
        SUB=min(piece, WRITE_SUB),
        KEY_BITS=key_bits,
        PACKED=packed,
        EMULATE=interpreting(),
        num_warps=_warps(piece),
    )
    if pieces == 1:
        return
    m_block = _merge_block(w, piece, out_block)
    _topk_merge_kernel[(t,)](
        sk,
        si,
        n_visible,
        out,
        w,
        out.stride(0),
        pieces,
        piece,
        K=k,
        OUT_BLOCK=out_block,
        M_BLOCK=m_block,
        KEY_BITS=key_bits,
        num_warps=max(4, min(16, m_block // 1024)),
    )


def _launch_stream(
    logits: Tensor,
    n_visible: Tensor,
    out: Tensor,
    key_bits: int,
    piece: int,
    stream: int,
    cap: int | None,
) -> None:
    """merge='stream': each piece's k-th key, then each row's candidates ≥ the largest of them
    compacted from memory (`cap` of them, else the row searched whole from memory)."""
    (t, w), k = logits.shape, out.shape[1]
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
        OUT_BLOCK=triton.next_power_of_2(k),
        P_BLOCK=max(16, triton.next_power_of_2(pieces)),
        STREAM_BLOCK=stream,
        CAP=cap,
        KEY_BITS=key_bits,
        num_warps=max(4, min(16, cap // 1024)),
    )
