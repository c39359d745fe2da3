"""Graph bucket metadata on CPU: padding, capacities, in-place refresh, and the padded-bucket
forward (what a graph replays) equal to the plain eager forward — without CUDA."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.batch import PrefillBatch, RequestSlice, build_metadata
from dsv4cp.config import DeepseekV41Config
from dsv4cp.cp.launch import run_cp
from dsv4cp.graphs.runner import GraphConfig, GraphRunner, StaticBatch
from dsv4cp.model import DeepseekV41Model
from dsv4cp.runner import PrefillRunner


def _meta(runner: PrefillRunner, prompts: dict[str, list[int]]):
    items = list(prompts.items())
    res = [runner.alloc.reserve(k, len(v)) for k, v in items]
    for r in res:
        runner.alloc.write_table(r)
    batch = PrefillBatch(
        tuple(RequestSlice(k, r.row, r.start, tuple(v)) for (k, v), r in zip(items, res))
    )
    meta = build_metadata(
        batch, runner.cache.req_to_token, [s for r in res for s in r.slots], runner.ratios
    )
    return meta, batch.input_ids("cpu"), res


def _runner(seed: int = 0, cp=None) -> PrefillRunner:  # noqa: ANN001
    model = DeepseekV41Model(DeepseekV41Config.tiny(), seed=seed)
    return PrefillRunner(model, cp=cp, num_slots=1024, max_context=256)


def test_refresh_pads_and_fits_reports_reasons() -> None:
    r = _runner()
    cfg = GraphConfig(buckets=(64,), max_requests=4, max_context=128)
    st = StaticBatch(64, cfg, r.cache.req_to_token, r.ratios, r.cp)
    meta, ids, _ = _meta(r, {"a": list(range(20)), "b": list(range(7))})
    assert st.fits(meta) is None
    st.refresh(meta, ids)
    t = st.tokens
    assert t.valid[:27].all() and not t.valid[27:].any()
    assert t.slots[27:].eq(0).all() and t.positions[27:].eq(0).all() and t.end[27:].eq(1).all()
    assert torch.equal(st.ids[:27], ids) and st.ids[27:].eq(0).all()
    ws = st.workspaces[1]
    assert torch.equal(ws.slots[:27], meta.workspaces[1].slots) and ws.slots[27:].eq(0).all()
    assert ws.max_entries == 128 and st.workspaces[2].max_entries == 64
    # Refresh with a smaller batch overwrites the old rows with padding.
    small, ids2, _ = _meta(r, {"c": [1, 2, 3]})
    st.refresh(small, ids2)
    assert st.tokens.valid.sum() == 3 and st.workspaces[1].slots[3:].eq(0).all()
    big, _, _ = _meta(r, {"d": list(range(65))})
    assert "65 tokens > bucket 64" in st.fits(big)
    long_ctx = GraphConfig(buckets=(64,), max_requests=4, max_context=16)
    assert "context" in StaticBatch(64, long_ctx, r.cache.req_to_token, r.ratios, r.cp).fits(meta)


def test_select_falls_back_when_nothing_fits() -> None:
    r = _runner()
    gr = GraphRunner(GraphConfig(buckets=(8, 32)), r.cp)
    for b in (8, 32):
        from dsv4cp.graphs.runner import BucketGraph, BucketReport

        gr.graphs[b] = BucketGraph(
            StaticBatch(b, gr.config, r.cache.req_to_token, r.ratios, r.cp),
            None,
            BucketReport(b, 0, 0, 1),
        )
    meta, _, _ = _meta(r, {"a": list(range(20))})
    assert gr.select(meta).static.bucket == 32
    meta2, _, _ = _meta(r, {"b": list(range(40))})
    assert gr.select(meta2) is None and gr.fallbacks == 1


def _bucket_vs_eager(group, bucket: int):  # noqa: ANN001
    """Run the same batch through the padded bucket body and through the eager path."""
    prompts = {"a": list(range(3, 40)), "b": list(range(100, 109)), "c": [5]}
    ref_runner, pad_runner = _runner(1, group), _runner(1, group)
    with torch.inference_mode():
        meta, ids, res = _meta(ref_runner, prompts)
        ref = ref_runner._eager(meta, ids)
        meta2, ids2, _ = _meta(pad_runner, prompts)
        st = StaticBatch(
            bucket,
            GraphConfig(buckets=(bucket,), max_context=256),
            pad_runner.cache.req_to_token,
            pad_runner.ratios,
            group,
        )
        st.refresh(meta2, ids2)
        pad_runner.graph_runner = GraphRunner(GraphConfig(buckets=(bucket,)), group)
        got = pad_runner._graph_body(st)[: meta2.tokens.num_rows]
    caches = [
        (k, v.clone(), pad_runner.cache.state_dict_view()[k])
        for k, v in ref_runner.cache.state_dict_view().items()
    ]
    return ref, got, caches


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_padded_bucket_forward_equals_eager(cp: int) -> None:
    out = run_cp(cp, _bucket_vs_eager, 64, backend="fake")[0]
    ref, got, caches = out
    assert got.shape == ref.shape
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
    for name, a, b in caches:
        # Padding rows write only to the dummy slot 0.
        assert float((a[1:] - b[1:]).abs().max()) <= 1e-5 * max(float(a.abs().max()), 1e-30), name


def test_graphs_need_cuda_and_accept_true() -> None:
    model = DeepseekV41Model(DeepseekV41Config.tiny(), seed=0)
    for graphs in (True, GraphConfig(buckets=(16,))):
        with pytest.raises(ValueError, match="graphs need a CUDA device"):
            PrefillRunner(model, num_slots=256, graphs=graphs)
    assert PrefillRunner(model, num_slots=256, graphs=False).graph_runner is None
    with pytest.raises(ValueError, match="buckets"):
        GraphConfig(buckets=())


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("buckets", {"buckets": (64, 0)}),
        ("buckets", {"buckets": (64, -8)}),
        ("buckets", {"buckets": (64.0,)}),
        ("buckets", {"buckets": (True,)}),
        ("buckets", {"buckets": 64}),
        ("buckets", {"buckets": "64"}),
        ("max_requests", {"max_requests": 0}),
        ("max_context", {"max_context": 2048.5}),
        ("max_batch_context", {"max_batch_context": -1}),
        ("max_batch_context", {"max_batch_context": 4096.0}),
        ("max_batch_context", {"max_batch_context": None}),
    ],
)
def test_graph_config_refuses_bad_fields(field: str, kwargs: dict) -> None:
    """A field out of range is a ValueError naming it (max_batch_context=-1 once gave a
    workspace of 7 rows: graphs silently never used)."""
    with pytest.raises(ValueError, match=f"GraphConfig.{field} must be"):
        GraphConfig(**kwargs)


def test_graph_config_accepts_lists_and_an_explicit_batch_context() -> None:
    assert GraphConfig(buckets=[16, 32], max_batch_context=4096).batch_context == 4096
    assert GraphConfig(max_context=100).batch_context == 200


def test_replay_outside_inference_mode() -> None:
    """Capture makes the static buffers under inference mode; a caller outside it (a bare
    `ServingEngine.forward`, as tests/gpu/test_sglang_engine.py does) must still replay: on the
    H200 this raised "Inplace update to inference tensor outside InferenceMode"."""
    from types import SimpleNamespace

    from dsv4cp.graphs.runner import BucketGraph, BucketReport

    r = _runner()
    gr = GraphRunner(GraphConfig(buckets=(32,)), r.cp)
    with torch.inference_mode():
        st = StaticBatch(32, gr.config, r.cache.req_to_token, r.ratios, r.cp)
    out = torch.arange(32.0)[:, None]
    bg = BucketGraph(st, SimpleNamespace(replay=lambda: out), BucketReport(32, 0, 0, 1))  # type: ignore[arg-type]
    meta, ids, _ = _meta(r, {"a": list(range(5))})
    assert not torch.is_inference_mode_enabled()
    hidden = gr.replay(bg, meta, ids)
    assert torch.equal(st.ids[:5], ids) and torch.equal(hidden, out[:5])
