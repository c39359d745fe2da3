"""The SWA pool rows from the batch's token metadata in Triton (twins: `dsv4cp.ops.pool_rows`):
one launch each where the torch ops take about twenty small ones (the window's [T, W] position
arithmetic, two gathers, the reversal and the slot → row map). The forward's first attention
layer computes both (the window in `layers/sparse_rows.py`, the SWA store's rows in
`layers/attention.py`), kept in `ctx.cross.attention` for the later layers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_T = 16  # window rows per program (× the window's power-of-two width)
BLOCK = 1024  # slots per program (`swa_rows`)


@triton.jit
def _pool_rows(s, ok, map_ptr, stride_map, table_ptr, PAGE, MAP: tl.constexpr):
    """int64 SWA rows of int64 slots `s` (−1 where s < 0, not held, or ~ok)."""
    safe = tl.maximum(s, 0)
    live = ok & (s >= 0)
    if MAP:
        rows = tl.load(map_ptr + safe * stride_map, mask=live, other=0).to(tl.int64)
        return tl.where(live & ((rows > 0) | (safe == 0)), rows, -1)
    else:
        page = tl.load(table_ptr + safe // PAGE, mask=live, other=-1).to(tl.int64)
        return tl.where(live & (page >= 0), page * PAGE + safe % PAGE, -1)


@triton.jit
def _swa_rows_kernel(
    slot_ptr, map_ptr, table_ptr, out_ptr, N, stride_map, PAGE,
    MAP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    s = tl.load(slot_ptr + i, mask=m, other=-1).to(tl.int64)
    tl.store(out_ptr + i, _pool_rows(s, m, map_ptr, stride_map, table_ptr, PAGE, MAP), mask=m)


@triton.jit
def _window_rows_kernel(
    pos_ptr, valid_ptr, req_ptr, r2t_ptr, map_ptr, table_ptr, out_ptr,
    T, W, stride_r2t, stride_map, PAGE,
    MAP: tl.constexpr, BT: tl.constexpr, BW: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    j = tl.arange(0, BW)
    tm = t < T
    pos = tl.load(pos_ptr + t, mask=tm, other=0).to(tl.int64)
    ok = tm & (tl.load(valid_ptr + t, mask=tm, other=0) != 0)
    base = r2t_ptr + tl.load(req_ptr + t, mask=tm, other=0).to(tl.int64) * stride_r2t
    # the newest-first slots of positions p, p−1, …: n of them are not −1
    p0 = pos[:, None] - j[None, :]
    see = ok[:, None] & (j < W)[None, :] & (p0 >= 0)
    s0 = tl.load(base[:, None] + tl.maximum(p0, 0), mask=see, other=-1).to(tl.int64)
    n = tl.sum((see & (s0 >= 0)).to(tl.int32), 1)
    # column j < n: newest-first entry n−1−j, i.e. ascending position
    p = pos[:, None] - (n[:, None] - 1 - j[None, :])
    put = ok[:, None] & (j[None, :] < n[:, None]) & (p >= 0)
    s = tl.load(base[:, None] + tl.maximum(p, 0), mask=put, other=-1).to(tl.int64)
    s = tl.where(put, s, -1)
    rows = _pool_rows(s, put, map_ptr, stride_map, table_ptr, PAGE, MAP)
    out = out_ptr + t.to(tl.int64)[:, None] * W + j[None, :]
    tl.store(out, rows.to(tl.int32), mask=tm[:, None] & (j < W)[None, :])


def _table_args(
    slot_map: Tensor | None, page_table: Tensor, page_size: int, what: str
) -> tuple[Tensor, int, bool]:
    if page_size < 1:
        raise ValueError(f"{what}: page_size must be ≥ 1, got {page_size}")
    if slot_map is not None:
        if slot_map.dim() != 1:
            raise ValueError(f"{what}: slot_map must be 1-d, got {tuple(slot_map.shape)}")
        return slot_map, slot_map.stride(0), True
    if page_table.dim() != 1 or not page_table.is_contiguous():
        raise ValueError(f"{what}: page_table must be a contiguous 1-d tensor")
    return page_table, 0, False


def swa_rows(slots: Tensor, slot_map: Tensor | None, page_table: Tensor, page_size: int) -> Tensor:
    """Twin of ops.pool_rows.swa_rows (slots contiguous, any shape)."""
    table, stride_map, use_map = _table_args(slot_map, page_table, page_size, "swa_rows")
    flat = slots.contiguous().view(-1)
    out = torch.empty(flat.shape, dtype=torch.int64, device=slots.device)
    if flat.numel():
        _swa_rows_kernel[(triton.cdiv(flat.numel(), BLOCK),)](
            flat, table, page_table, out, flat.numel(), stride_map, page_size,
            MAP=use_map, BLOCK=BLOCK,
        )  # fmt: skip
    return out.view(slots.shape)


def window_rows(
    positions: Tensor,
    valid: Tensor,
    req_row: Tensor,
    req_to_token: Tensor,
    window: int,
    slot_map: Tensor | None,
    page_table: Tensor,
    page_size: int,
) -> Tensor:
    """Twin of ops.pool_rows.window_rows: one program per BLOCK_T rows."""
    table, stride_map, use_map = _table_args(slot_map, page_table, page_size, "window_rows")
    if window < 1:
        raise ValueError(f"window_rows: window must be ≥ 1, got {window}")
    t = positions.shape[0] if positions.dim() == 1 else -1
    if t < 0 or valid.shape != (t,) or req_row.shape != (t,):
        raise ValueError("window_rows: positions, valid and req_row must be [T] alike")
    if req_to_token.dim() != 2 or req_to_token.stride(1) != 1:
        raise ValueError("window_rows: req_to_token must be [requests, context], unit stride")
    out = torch.empty((t, window), dtype=torch.int32, device=positions.device)
    if t:
        _window_rows_kernel[(triton.cdiv(t, BLOCK_T),)](
            positions.contiguous(), valid.contiguous(), req_row.contiguous(), req_to_token,
            table, page_table, out, t, window, req_to_token.stride(0), stride_map, page_size,
            MAP=use_map, BT=BLOCK_T, BW=triton.next_power_of_2(window),
        )  # fmt: skip
    return out
