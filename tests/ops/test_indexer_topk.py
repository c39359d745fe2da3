"""ops.indexer_topk: each fused op is its composition of ops.indexer, whatever the row chunking."""

from __future__ import annotations

import pytest
import torch

from dsv4cp import ops, routing
from dsv4cp.ops import indexer_topk


def _inputs(t: int = 23, h: int = 4, d: int = 16, n: int = 90, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g)
    w = torch.randn(t, h, generator=g)
    k = torch.randn(n, d, generator=g)
    nv = torch.randint(0, n + 1, (t,), generator=g)
    nv[:3] = torch.tensor([0, n, 5])
    ks = torch.cat([torch.zeros(t // 2, dtype=torch.long), torch.full((t - t // 2,), 20)])
    nv = torch.minimum(nv, n - ks)
    return q, w, k, nv, ks


@pytest.mark.parametrize("budget", [indexer_topk.LOGITS_BUDGET_BYTES, 4 * 70 * 5])
def test_compositions(monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    monkeypatch.setattr(indexer_topk, "LOGITS_BUDGET_BYTES", budget)  # 5-row chunks
    q, w, k, nv, ks = _inputs()
    logits = ops.mqa_logits(q, w, k, nv, k_start=ks, width=70)
    want = ops.topk_indices(logits, nv, 8)
    assert torch.equal(ops.mqa_topk(q, w, k, nv, 8, k_start=ks, width=70), want)
    top, blocks = ops.mqa_topk_candidates(q, w, k, nv, 8, 4, 6, k_start=ks, width=70)
    assert torch.equal(top, want)
    assert torch.equal(blocks, ops.candidate_blocks(logits, nv, 4, 6))
    ids = torch.randint(-1, 20, (q.shape[0], 5)).int()
    got = ops.mqa_topk_among_blocks(q, w, k, nv, ids, 4, 8, k_start=ks, width=70)
    assert torch.equal(got, ops.topk_among_blocks(logits, nv, ids, 4, 8))


def test_no_rows_and_routing_on_cpu() -> None:
    q, w, k, nv, _ = _inputs()
    empty = ops.mqa_topk(q[:0], w[:0], k, nv[:0], 8)
    assert empty.shape == (0, 8) and empty.dtype == torch.int32
    top, blocks = ops.mqa_topk_candidates(q[:0], w[:0], k, nv[:0], 8, 4, 3)
    assert top.shape == (0, 8) and blocks.shape == (0, 3)
    assert torch.equal(routing.mqa_topk(q, w, k, nv, 8), ops.mqa_topk(q, w, k, nv, 8))
