"""The merge of a row's pieces: when the scan splits the width into pieces, each piece leaves a
buffer that holds its top K (exactly those after a last cut, W_PAD = K_PAD; or the running
buffer as it is, ≤ CAP keys, W_PAD = CAP); `merge_kernel` takes, per row, the top K of the
pieces' buffers (≤ pieces·W_PAD keys, in column order) in registers (`kernels.topk`'s
selection, its search over KEY_BITS as the scan's cuts), -1 pads; rows with at most K visible
columns (PREFIX) get every visible column."""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4cp.kernels.topk_common import kth_key, store_prefix, store_selection


@triton.jit
def merge_kernel(
    sk_ptr, si_ptr, cnt_ptr, nvis_ptr, out_ptr, redo_ptr, WIDTH, PIECES, stride_ot,
    K: tl.constexpr, K_PAD: tl.constexpr, P_PAD: tl.constexpr, CAP: tl.constexpr,
    W_PAD: tl.constexpr, PREFIX: tl.constexpr, KEY_BITS: tl.constexpr,
    FLAG: tl.constexpr, REDO: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    if REDO:  # merge again only the rows the seeded pass left short
        if tl.load(redo_ptr + row) == 0:
            return
    out_row = out_ptr + row * stride_ot
    n = tl.maximum(tl.minimum(tl.load(nvis_ptr + row).to(tl.int32), WIDTH), 0)
    if PREFIX and n <= K:
        store_prefix(out_row, n, K, K_PAD)
        if FLAG:
            tl.store(redo_ptr + row, tl.zeros([], dtype=tl.int8))
    else:
        p = tl.arange(0, P_PAD)
        o = tl.arange(0, K_PAD)
        e = tl.arange(0, W_PAD)
        c = tl.load(cnt_ptr + row * PIECES + p, mask=p < PIECES, other=0)
        live = e[None, :] < c[:, None]
        at = (row * PIECES + p)[:, None] * CAP + e[None, :]
        keys = tl.reshape(tl.load(sk_ptr + at, mask=live, other=-2147483648), [P_PAD * W_PAD])
        idx = tl.reshape(tl.load(si_ptr + at, mask=live, other=0), [P_PAD * W_PAD])
        held = tl.sum(c, 0)
        total = tl.minimum(held, K)
        if FLAG:  # the seeded scan's pieces hold fewer than K keys ≥ the seed: redo the row
            tl.store(redo_ptr + row, (held < K).to(tl.int8))
        tl.store(out_row + o, tl.full([K_PAD], -1, tl.int32), mask=(o >= total) & (o < K))
        store_selection(keys, idx, keys > -2147483648, kth_key(keys, K, KEY_BITS), out_row, K)
