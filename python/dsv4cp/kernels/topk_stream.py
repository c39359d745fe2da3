"""merge="stream" of `kernels/topk.py`, for rows whose pieces' slots exceed its MAX_MERGE keys:
one program per 16K piece finds its k-th key, the largest of those bounds the row's k-th from
below; one program per row compacts the keys ≥ it from memory (at most pieces·k plus ties, in
index order) and selects among them. A row whose candidates overflow that buffer (heavy ties) is
searched whole from memory (a pass per step, one more)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv4cp.kernels.topk_common import (
    kth_key,
    load_keys,
    piece_warps,
    row_count,
    store_prefix,
    store_selection,
    stream_kth,
    write_streamed,
)

CHUNK = 16384  # merge="stream"'s piece, in registers
STREAM = 4096  # chunk width of the streaming passes
MAX_CAP = 16384


@triton.jit
def _stream_select(
    row_ptr, out_row, n, K: tl.constexpr, BLOCK: tl.constexpr, KEY_BITS: tl.constexpr
):
    """Whole-row search from memory (`stream_kth`), then one writing pass."""
    tau, n_gt = stream_kth(row_ptr, n, K, BLOCK, KEY_BITS)
    write_streamed(row_ptr, 0, n, tau, K - n_gt, out_row, out_row, False, BLOCK)


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
    n = row_count(nvis_ptr, row, W)
    start = piece * BLOCK
    tau = tl.full([], -2147483648, tl.int32)  # a piece with ≤ K keys bounds nothing
    if tl.minimum(n - start, BLOCK) > K:
        keys = load_keys(logits_ptr + row * stride_lt, start + tl.arange(0, BLOCK), n)
        tau = kth_key(keys, K, KEY_BITS)
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
    n = row_count(nvis_ptr, row, W)
    row_ptr = logits_ptr + row * stride_lt
    out_row = out_ptr + row * stride_ot
    if n <= K:
        store_prefix(out_row, n, K, OUT_BLOCK)
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
            kc = load_keys(row_ptr, cc, n)
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
            store_selection(keys, idx, j < cnt, kth_key(keys, K, KEY_BITS), out_row, K)
        else:
            _stream_select(row_ptr, out_row, n, K, STREAM_BLOCK, KEY_BITS)


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
        num_warps=piece_warps(piece),
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
