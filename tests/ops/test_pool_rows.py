"""`ops.pool_rows`: the window's SWA rows and the slot → SWA row map against their definitions,
row by row in Python, in both cache modes (the page table with pages not held; an external
allocator's slot map, a real one with slots not held and the expanded all-zero one a cache
starts with), with padding rows, positions before W and req_to_token in int32 and int64."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.ops.pool_rows import swa_rows, window_rows


def _row_of(slot: int, slot_map: torch.Tensor | None, table: torch.Tensor, page: int) -> int:
    if slot < 0:
        return -1
    if slot_map is not None:
        r = int(slot_map[slot])
        return r if (r > 0 or slot == 0) else -1
    p = int(table[slot // page])
    return p * page + slot % page if p >= 0 else -1


def _inputs(mode: str, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    page, n_slots = 4, 64
    r2t = torch.randperm(n_slots, generator=g)[: 3 * 20].view(3, 20).to(dtype)  # slots ≥ 0
    positions = torch.tensor([0, 1, 5, 19, 12, 0, 7, 3])
    req_row = torch.tensor([0, 0, 1, 2, 1, 0, 2, 1])
    valid = torch.tensor([True, True, True, True, True, False, True, True])
    table = torch.randint(-1, 16, (n_slots // page,), generator=g, dtype=torch.int32)
    table[17 // page] = -1  # a page not held
    slot_map = None
    if mode == "map":
        slot_map = torch.randint(0, 40, (n_slots,), generator=g)  # 0: not held
        slot_map[0] = slot_map[17] = 0  # 17: a slot not held
    elif mode == "map-empty":  # what a cache in swa_slots mode holds before the owner's map
        slot_map = torch.zeros(1, dtype=torch.long).expand(n_slots)
    return positions, valid, req_row, r2t, slot_map, table, page


@pytest.mark.parametrize("mode", ["pages", "map", "map-empty"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("window", [1, 4, 6])
def test_window_rows_are_the_window_in_ascending_position(
    mode: str, dtype: torch.dtype, window: int
) -> None:
    positions, valid, req_row, r2t, slot_map, table, page = _inputs(mode, dtype)
    got = window_rows(positions, valid, req_row, r2t, window, slot_map, table, page)
    assert got.dtype == torch.int32 and got.shape == (positions.shape[0], window)
    for t in range(positions.shape[0]):
        p = int(positions[t])
        seen = list(range(max(0, p - window + 1), p + 1)) if bool(valid[t]) else []
        want = [_row_of(int(r2t[req_row[t], q]), slot_map, table, page) for q in seen]
        want += [-1] * (window - len(want))
        assert got[t].tolist() == want, (t, mode)


@pytest.mark.parametrize("mode", ["pages", "map", "map-empty"])
def test_swa_rows_maps_each_slot(mode: str) -> None:
    _, _, _, _, slot_map, table, page = _inputs(mode, torch.int64, seed=3)
    slots = torch.tensor([[-1, 0, 1, 5], [17, 63, 32, 2]])
    got = swa_rows(slots, slot_map, table, page)
    assert got.dtype == torch.int64
    want = [[_row_of(int(s), slot_map, table, page) for s in row] for row in slots]
    assert got.tolist() == want
    if mode != "map-empty":  # the definition has rows held and rows not held here
        assert (got >= 0).any() and (got[slots >= 0] == -1).any()
