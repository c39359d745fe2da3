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
keys at a time (`write_streamed`, which keeps the kernel at half the registers of an in-register
prefix sum), and writes those ≤ k keys and indices to the piece's slot; a row that is one piece is
selected there outright. (2) one program per row selects among its pieces' slots, read piece by
piece (so in index order). That is exact: the row's k-th largest key τ is ≥ every piece's, so each
selected key > τ is above its piece's k-th too, and when τ is a piece's own k-th, the row's first
ties in index order are that piece's first ties (fewer keys above τ in the piece than in the row
leaves the piece more room for ties).
Rows whose pieces' slots exceed MAX_MERGE keys (pieces × k) take `merge="stream"`
(`topk_stream`). The jit helpers both merges use are `topk_common`'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv4cp.kernels._triton import interpreting
from dsv4cp.kernels.topk_bf16x2 import kth_bf16x2
from dsv4cp.kernels.topk_common import (
    kth_key,
    load_keys,
    piece_warps,
    row_count,
    sortable_key,
    store_prefix,
    store_selection,
    stream_kth,
    write_streamed,
)
from dsv4cp.kernels.topk_stream import CHUNK, STREAM, _launch_stream

MAX_K = 4096
WRITE_SUB = 2048  # keys at a time of a selection written from memory (`write_streamed`)
MAX_MERGE = 16384  # slots (pieces × k, padded to powers of two) one merge program holds
SLOT_PIECES = (4096, 8192, 16384)  # merge="slots"' piece widths, narrowest first


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
        tau = sortable_key(tau_x)  # τ's key, as load_keys makes the keys
        all_ties = ok and n_ge == K  # no key == τ left out
        if not ok:
            tau, n_gt = stream_kth(row_ptr + start, m, K, SUB, KEY_BITS)  # from memory
    else:
        keys = load_keys(row_ptr, start + tl.arange(0, BLOCK), end)
        tau = kth_key(keys, K, KEY_BITS)
        n_gt = tl.sum((keys > tau).to(tl.int32), 0)
    if all_ties:  # the keys ≥ τ: one prefix sum
        write_streamed(row_ptr, start, end, tau, 0, dst_i, dst_k, STORE_KEYS, SUB, True)
    else:
        write_streamed(row_ptr, start, end, tau, K - n_gt, dst_i, dst_k, STORE_KEYS, SUB)


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
    n = row_count(nvis_ptr, row, W)
    row_ptr = logits_ptr + row * stride_lt
    start = piece * BLOCK
    if n <= BLOCK:  # the row is its first piece: selected here, the merge skips it
        if piece == 0:
            out_row = out_ptr + row * stride_ot
            if n <= K:
                store_prefix(out_row, n, K, OUT_BLOCK)
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
            tl.store(sk_ptr + slot + o, load_keys(row_ptr, start + o, n), mask=o < m)
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
    n = row_count(nvis_ptr, row, W)
    out_row = out_ptr + row * stride_ot
    if n > PIECE:  # narrower rows: the piece kernel selected them
        if n <= K:
            store_prefix(out_row, n, K, OUT_BLOCK)
        else:
            j = tl.arange(0, M_BLOCK)
            p = j // OUT_BLOCK
            s = j % OUT_BLOCK
            filled = tl.minimum(tl.minimum(tl.maximum(n - p * PIECE, 0), PIECE), K)
            ok = (p < PIECES) & (s < filled)
            off = (row * PIECES + p) * K + s
            keys = tl.load(sk_ptr + off, mask=ok, other=-2147483648)
            idx = tl.load(si_ptr + off, mask=ok, other=0)
            store_selection(keys, idx, ok, kth_key(keys, K, KEY_BITS), out_row, K)


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
        num_warps=piece_warps(piece),
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
