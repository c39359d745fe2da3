"""The SWA pool rows the attention reads and writes, from the batch's token metadata, in torch
(twins of `dsv4cp.kernels.pool_rows`).

`swa_rows` maps token slots to SWA pool rows: through `slot_map` (`swa_slots` mode: an external
allocator's token slot → SWA slot, 0 = not held, slot 0 → the dummy row 0) or else through the
per-page `page_table` (token page → SWA page, −1 = not held). `window_rows` is each query's
sliding window as SWA rows: positions p−n+1 … p in ascending order, then −1 pads (n = the
window's visible positions), the order of the reference's `get_window_topk_idxs` that the
attention's fp32 sums follow.
"""

from __future__ import annotations

import torch
from torch import Tensor


def swa_rows(slots: Tensor, slot_map: Tensor | None, page_table: Tensor, page_size: int) -> Tensor:
    """int64 SWA pool rows of token `slots` (any shape; −1 for slot −1 or a slot not held)."""
    safe = slots.long().clamp(min=0)
    if slot_map is not None:
        rows = slot_map[safe].long()
        return torch.where((slots >= 0) & ((rows > 0) | (safe == 0)), rows, -1)
    page = page_table[torch.div(safe, page_size, rounding_mode="floor")].long()
    rows = page * page_size + safe % page_size
    return torch.where((slots >= 0) & (page >= 0), rows, -1)


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
    """int32 [T, window] SWA rows of each row's window (see the module docstring); padding rows
    (`valid` False) and positions before 0 are −1. The slots of positions p, p−1, …, p−W+1 are
    read from `req_to_token[req_row]`; with n of them not −1, column j < n holds the row of
    position p−n+1+j (ascending; −1 where that slot is −1 or not held) and the rest −1. When
    every slot the window reads is set (as the allocators keep them), n = min(W, p+1)."""
    off = torch.arange(window, device=positions.device)
    pos = positions[:, None] - off[None, :]
    slots = req_to_token[req_row[:, None], pos.clamp(min=0)].long()
    slots = torch.where((pos >= 0) & valid[:, None], slots, -1)
    n = (slots >= 0).sum(dim=1, keepdim=True)
    # column j < n holds entry n−1−j of the newest-first list: ascending position
    slots = torch.where(off < n, slots.gather(1, (n - 1 - off).clamp(min=0)), -1)
    return swa_rows(slots, slot_map, page_table, page_size).to(torch.int32)
