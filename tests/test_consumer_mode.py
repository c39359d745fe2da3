"""A candidate consumer's mode (gather its published blocks, or scan every visible key): the plan,
the batch's mean visible keys it reads, and the layer and launcher passing them."""

from __future__ import annotations

import pytest
import torch
from benchmarks.layer_peer_setup import build_layers, make_context

from dsv4cp.batch import PrefillBatch, RequestSlice, build_metadata, visible_entries
from dsv4cp.config import DeepseekV41Config
from dsv4cp.kernels import indexer_topk
from dsv4cp.kernels.indexer_topk_plan import plan_gather
from dsv4cp.layers import attention as layer_module

PUBLISHED = 2048 * 8  # Flash: 2048 blocks of 8 positions


def test_the_plan_reads_the_mean_and_falls_back_to_the_width() -> None:
    assert not plan_gather(65536, PUBLISHED, 32768.5)  # cold 64K: 2x, the map won by 12 %
    assert plan_gather(122880, PUBLISHED, 122880.5 - 8192)  # 16K after 112K: ~7x, the gather 2x
    assert plan_gather(131072, PUBLISHED, 3 * PUBLISHED)  # from 3x
    assert not plan_gather(131072, PUBLISHED, 3 * PUBLISHED - 1)
    assert plan_gather(65536, PUBLISHED, None)  # a graph bucket: the width, as before
    assert not plan_gather(65535, PUBLISHED, None)


@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_visible_entries_is_the_sum_it_names(ratio: int) -> None:
    for n in range(0, 70):
        assert visible_entries(n, ratio) == sum((p + 1) // ratio for p in range(n))


def test_the_batch_mean_is_the_new_tokens_mean_visible_entries() -> None:
    req_to_token = torch.zeros(3, 64, dtype=torch.long)
    req_to_token[0, :40] = torch.arange(1, 41)
    req_to_token[2, :21] = torch.arange(41, 62)
    batch = PrefillBatch(
        (RequestSlice("a", 0, 30, tuple(range(10))), RequestSlice("b", 2, 0, tuple(range(21))))
    )
    slots = torch.cat([req_to_token[0, 30:40], req_to_token[2, :21]])
    meta = build_metadata(batch, req_to_token, slots, (1, 2))
    for r in (1, 2):
        want = meta.tokens.n_visible(r).double().mean().item()
        assert meta.workspaces[r].mean_visible == pytest.approx(want, rel=1e-12)


def test_the_consumer_layer_passes_the_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = DeepseekV41Config.tiny()
    source, consumer = 3, 5  # the tiny config's ratio-1 candidate source and consumer
    assert cfg.layer_role(consumer).candidate_consumer
    layers = build_layers(cfg, (source, consumer), torch.float32, "cpu", quant="qat")
    ctx = make_context(cfg, 80, 32, "cpu", torch.float32, "qat")
    seen: list[float | None] = []
    real = layer_module.mqa_topk_cached

    def spy(*args: object, **kw: object) -> object:
        seen.append(kw.get("mean_visible"))  # type: ignore[arg-type]
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(layer_module, "mqa_topk_cached", spy)
    x = torch.randn(32, cfg.hidden_size)
    with torch.inference_mode():
        for i in (source, consumer):
            layers[i].forward(x, ctx)
    want = sum((p + 1) for p in range(80, 112)) / 32  # ratio 1: position p sees p + 1 entries
    assert seen == [pytest.approx(want), pytest.approx(want)]


def test_the_launcher_gathers_when_the_plan_says(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(indexer_topk, "launch_gather", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(indexer_topk, "member_kernel", _Refused())  # the map mode's first launch
    t, blocks, bs = 4, 2, 8  # 16 published positions
    q, w = torch.zeros(t, 2, 16), torch.zeros(t, 2)
    ids = torch.zeros(t, blocks, dtype=torch.int32)

    def launch(width: int, mean: float) -> None:
        k, nv = torch.zeros(width, 16), torch.full((t,), width, dtype=torch.int32)
        indexer_topk.launch_mqa_topk(
            q, w, k, nv, 4, block_ids=ids, block_size=bs, config=(16, 16, 4, 1), mean_visible=mean
        )

    launch(60, 48.0)  # the width alone (< 4 x 16) would scan; the mean (3 x 16) gathers
    assert calls == [1]
    with pytest.raises(_Scanned):
        launch(64, 20.0)  # the width alone (4 x 16) would gather; the mean scans
    assert calls == [1]


class _Scanned(Exception):
    pass


class _Refused:
    def __getitem__(self, grid: object) -> object:
        def launch(*a: object, **k: object) -> None:
            raise _Scanned

        return launch
