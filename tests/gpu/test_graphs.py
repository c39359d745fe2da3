"""Breakable CUDA graphs (CUDA): replay equals eager for every layer role at several live lengths
per bucket, with prefixes, at contexts longer than any seen at capture, multistream on and off,
FakeCPGroup CP ∈ {1, 2}; batches above the largest bucket fall back to eager."""

from __future__ import annotations

import warnings

import pytest
import torch

from dsv4cp.config import DeepseekV41Config
from dsv4cp.cp.launch import run_cp
from dsv4cp.graphs.bcg import BreakableGraph, eager_break
from dsv4cp.graphs.runner import GraphConfig
from dsv4cp.kernels import indexer_topk
from dsv4cp.model import DeepseekV41Model
from dsv4cp.runner import PrefillRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    # the FakeCPGroup runs left empty segments between breaks, and torch warned of each
    pytest.mark.filterwarnings("error:The CUDA Graph is empty"),
]

TOL = 1e-4  # fp32; GEMMs over bucket rows may pick other kernels than over live rows

# (prefix batch, chunk batch): live lengths 1..64 within buckets 16/64, prefixes up to 150.
STEPS = [
    ({"a": 9}, {"a": 7}),
    ({"b": 150, "c": 3}, {"b": 40, "c": 13, "d": 1}),
    ({}, {"e": 64}),
    ({}, {"f": 200}),  # above the largest bucket: eager fallback
]


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(group, multistream: bool):  # noqa: ANN001
    cfg = DeepseekV41Config.tiny()
    model = DeepseekV41Model(cfg, device="cuda", seed=2)
    gcfg = GraphConfig(buckets=(16, 64), max_requests=4, max_context=256)
    graphs = PrefillRunner(
        model, cp=group, multistream=multistream, num_slots=2048, max_context=512, graphs=gcfg
    )
    eager = PrefillRunner(model, cp=group, num_slots=2048, max_context=512)
    diffs = []
    for i, (pre, chunk) in enumerate(STEPS):
        for runner in (graphs, eager):
            if pre:
                runner.prefill({k: _tokens(n, ord(k)) for k, n in pre.items()})
        new = {k: _tokens(n, 7 * i + len(k)) for k, n in chunk.items()}
        a = graphs.prefill(new, return_all_logits=True).all_logits
        b = eager.prefill(new, return_all_logits=True).all_logits
        diffs.append(float((a - b).abs().max() / b.abs().max()))
    caches = max(
        float((graphs.cache.state_dict_view()[k][1:] - v[1:]).abs().max())
        for k, v in eager.cache.state_dict_view().items()
    )
    return diffs, caches, graphs.graph_runner.fallbacks, graphs.graph_runner.reports()


@pytest.mark.parametrize("multistream", [False, True], ids=["serial", "multistream"])
@pytest.mark.parametrize("cp", [1, 2])
def test_graph_replay_equals_eager(cp: int, multistream: bool) -> None:
    diffs, caches, fallbacks, reports = run_cp(cp, _run, multistream, backend="fake")[0]
    assert max(diffs) < TOL, diffs
    assert caches < 1e-3, caches
    assert fallbacks == 2  # the 153-token prefix batch and the 200-token batch
    assert [r.tokens for r in reports] == [16, 64]
    if cp > 1:  # FakeCPGroup gathers are eager breaks: several segments
        assert all(r.segments > 1 for r in reports)
    else:
        assert all(r.segments == 1 for r in reports)


def test_graph_replay_equals_eager_on_the_scan_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same, CP 2 multistream, with the index sources' plain top-k on the fused scan: the
    tiny model's widths would take the logits route (`indexer_topk.pick_route`)."""
    monkeypatch.setattr(indexer_topk, "LOGITS_ROUTE_MAX_WIDTH", 0)
    monkeypatch.setattr(indexer_topk, "LOGITS_ROUTE_KEYS_PER_ROW", 0)  # nor by rows
    diffs, caches, fallbacks, _ = run_cp(2, _run, True, backend="fake")[0]
    assert max(diffs) < TOL, diffs
    assert caches < 1e-3, caches
    assert fallbacks == 2


def test_two_breaks_in_a_row_leave_an_empty_segment_that_is_not_replayed() -> None:
    x = torch.arange(8.0, device="cuda")

    def fn() -> torch.Tensor:
        a = eager_break(lambda t: t + 1, x * 2)
        b = eager_break(lambda t: t * 3, a)
        return b - 1

    graph = BreakableGraph()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = graph.capture(fn)
    assert not [w for w in caught if "CUDA Graph is empty" in str(w.message)]
    assert graph.num_segments == 3 and graph.empty == {1}
    for _ in range(2):
        x.add_(1)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, (x * 2 + 1) * 3 - 1)
