"""`kernels.pool_rows` on the GPU, bit for bit `ops.pool_rows` on the same CUDA tensors, at a
16K chunk after a 112K prefix (two requests, W = 128, both cache modes), and through the
routed ops (`routing.window_rows` / `swa_rows` pick the kernel for CUDA tensors)."""

from __future__ import annotations

import pytest
import torch

from dsv4cp import routing
from dsv4cp.kernels import pool_rows as kern
from dsv4cp.ops import pool_rows as ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("mode", ["pages", "map"])
def test_pool_rows_kernels_equal_the_twins_on_the_gpu(mode: str) -> None:
    dev, page, ctx = "cuda", 64, 131072
    g = torch.Generator(device=dev).manual_seed(0)
    n_slots = 2 * ctx
    r2t = torch.randperm(n_slots, device=dev, generator=g)[: 2 * ctx].view(2, ctx).int()
    positions = torch.cat([114688 + torch.arange(16000, device=dev), torch.arange(384, device=dev)])
    req_row = torch.cat([torch.zeros(16000, device=dev), torch.ones(384, device=dev)]).long()
    valid = torch.rand(positions.shape[0], device=dev, generator=g) > 0.01
    table = torch.randint(-1, n_slots // page, (n_slots // page,), device=dev, generator=g)
    table = table.int()
    slot_map = None
    if mode == "map":
        slot_map = torch.randint(0, 1 << 20, (n_slots,), device=dev, generator=g)
        slot_map[::5] = 0
    args = (positions, valid, req_row, r2t, 128, slot_map, table, page)
    want = ops.window_rows(*args)
    assert torch.equal(kern.window_rows(*args), want)
    assert torch.equal(routing.window_rows(*args), want)
    assert bool((want >= 0).any()) and bool((want == -1).any())
    slots = r2t[0, 114688 : 114688 + 16384].long()
    want_rows = ops.swa_rows(slots, slot_map, table, page)
    assert torch.equal(kern.swa_rows(slots, slot_map, table, page), want_rows)
    assert torch.equal(routing.swa_rows(slots, slot_map, table, page), want_rows)
