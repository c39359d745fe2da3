"""The prepare schedule: every layer role's DAG is valid, planted mistakes are caught, and any
issue order the declared dependencies allow gives bit-identical results (CPU, serial)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4cp.config import DeepseekV41Config
from dsv4cp.executors import SerialExecutor
from dsv4cp.layers.attention import DeepseekV41Attention
from dsv4cp.model import DeepseekV41Model
from dsv4cp.runner import PrefillRunner
from dsv4cp.schedule import (
    DEFAULT,
    Fork,
    Join,
    Node,
    PrepareState,
    Release,
    Schedule,
    ScheduleError,
    validate,
)


def _schedules(cfg: DeepseekV41Config, overlap_gathers: bool = True) -> list[Schedule]:
    # On the meta device: the schedules of the real Flash layers, without their weights.
    return [
        DeepseekV41Attention(cfg, i, device="meta").schedule(overlap_gathers)
        for i in range(cfg.num_hidden_layers)
    ]


@pytest.mark.parametrize("preset", ["tiny", "flash"])
def test_every_layer_role_schedule_is_valid(preset: str) -> None:
    cfg = getattr(DeepseekV41Config, preset)()
    scheds = _schedules(cfg)
    assert len(scheds) == cfg.num_hidden_layers
    for s in scheds:
        validate(s)
        # Gathers come first, in one fixed order: kv latent, then compressor projections.
        assert s.collectives() in (["gather_kv"], ["gather_kv", "gather_comp"])
        names = [n.name for n in s.nodes]
        assert names.index("q_chain") < names.index("gather_kv")  # Q overlaps the gathers
        assert all(n.lane == DEFAULT for n in s.nodes if n.collective)


def _layer2() -> Schedule:
    return _schedules(DeepseekV41Config.tiny())[1]  # ratio-2 kv source + index source


def _edit(s: Schedule, steps: list) -> Schedule:
    return dataclasses.replace(s, steps=tuple(steps))


def _find(s: Schedule, pred) -> int:
    return next(i for i, st in enumerate(s.steps) if pred(st))


def test_reading_before_the_writer_is_rejected() -> None:
    s = _layer2()
    steps = [st for st in s.steps if not (isinstance(st, Node) and st.name == "qkv_a")]
    with pytest.raises(ScheduleError, match="reads 'q_raw' before any writer"):
        validate(_edit(s, steps))


def test_collective_inside_the_fork_is_rejected() -> None:
    s = _layer2()
    steps = list(s.steps)
    g = steps.pop(_find(s, lambda st: isinstance(st, Node) and st.name == "gather_comp"))
    fork = next(i for i, st in enumerate(steps) if isinstance(st, Fork) and not st.compute_only)
    steps.insert(fork + 1, g)
    with pytest.raises(ScheduleError, match="collective inside the fork/join region"):
        validate(_edit(s, steps))


def test_collective_on_a_side_lane_is_rejected() -> None:
    s = _layer2()
    steps = [
        dataclasses.replace(st, lane="swa")
        if isinstance(st, Node) and st.name == "gather_kv"
        else st
        for st in s.steps
    ]
    with pytest.raises(ScheduleError, match="collective on lane 'swa'|runs before its fork"):
        validate(_edit(s, steps))


def test_freeing_a_side_stream_input_before_the_join_is_rejected() -> None:
    s = _layer2()
    steps = list(s.steps)
    join = _find(s, lambda st: isinstance(st, Join))
    steps.insert(join, Release(("swa_rows_g",)))
    with pytest.raises(ScheduleError, match="'swa_rows_g' is released while lane 'swa'"):
        validate(_edit(s, steps))


def test_reading_a_side_output_before_the_join_is_rejected() -> None:
    s = _layer2()
    steps = list(s.steps)
    node = steps.pop(_find(s, lambda st: isinstance(st, Node) and st.name == "logits_topk"))
    steps.insert(_find(s, lambda st: isinstance(st, Join)) - 1, node)
    with pytest.raises(ScheduleError, match="without a fork/join ordering them"):
        validate(_edit(s, steps))


def test_side_lane_reading_default_work_issued_after_its_fork_is_rejected() -> None:
    s = _layer2()
    steps = list(s.steps)
    qn = steps.pop(_find(s, lambda st: isinstance(st, Node) and st.name == "q_norm"))
    steps.insert(_find(_edit(s, steps), lambda st: isinstance(st, Fork)) + 1, qn)
    with pytest.raises(ScheduleError, match="'q_lora'"):
        validate(_edit(s, steps))


def test_compute_only_lane_reading_gathered_rows_is_rejected() -> None:
    s = _layer2()
    bad = Node("peek", lambda st: None, ("swa_rows_g",), ("peek",), lane="q")
    steps = list(s.steps)
    steps.insert(_find(s, lambda st: isinstance(st, Fork) and not st.compute_only), bad)
    with pytest.raises(ScheduleError, match="'swa_rows_g' written on lane 'default' without"):
        validate(_edit(s, steps))


def test_unjoined_lane_and_missing_write_are_rejected() -> None:
    s = _layer2()
    steps = list(s.steps[: _find(s, lambda st: isinstance(st, Join))])
    with pytest.raises(ScheduleError, match="never joined"):
        validate(_edit(s, steps))
    lazy = Schedule("lazy", (Node("n", lambda st: None, ("x",), ("y",)),), ("x",), ("y",))
    validate(lazy)
    with pytest.raises(ScheduleError, match="did not write"):
        SerialExecutor().run(lazy, PrepareState(None, x=1), check=True)


def _reorder(s: Schedule, reverse_lanes: bool) -> Schedule:
    """Another issue order the declared dependencies allow: every side-lane node moved to just
    before its lane's join (after all default-lane work in between), lanes optionally reversed."""
    fixed = [st for st in s.steps if not (isinstance(st, Node) and st.lane != DEFAULT)]
    side = [st for st in s.steps if isinstance(st, Node) and st.lane != DEFAULT]
    if reverse_lanes:
        side = side[::-1]
    out: list = []
    for st in fixed:
        if isinstance(st, Join):
            out.extend(n for n in side if n.lane in st.lanes)
        out.append(st)
    return _edit(s, out)


@pytest.mark.parametrize("reverse_lanes", [False, True], ids=["side-late", "side-late-reversed"])
def test_any_allowed_issue_order_gives_identical_results(reverse_lanes: bool) -> None:
    cfg = DeepseekV41Config.tiny()
    torch.manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (70,)).tolist()
    ref_model = DeepseekV41Model(cfg, seed=3)
    ref = PrefillRunner(ref_model, num_slots=512).prefill({"a": prompt}, return_all_logits=True)
    model = DeepseekV41Model(cfg, seed=3)
    changed = 0
    for layer in model.layers:
        new = _reorder(layer.attn.schedule(), reverse_lanes)
        validate(new)
        changed += [n.name for n in new.nodes] != [n.name for n in layer.attn.schedule().nodes]
        layer.attn.schedules[True] = new
    assert changed >= 3
    got = PrefillRunner(model, num_slots=512).prefill({"a": prompt}, return_all_logits=True)
    assert torch.equal(got.all_logits, ref.all_logits)
