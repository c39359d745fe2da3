"""CP=N equals CP=1: logits, per-layer hidden rows, every cache and the top-k sets (fp32, 1e-5).

The whole matrix runs through FakeCPGroup (all ranks as threads of this process) and through real
gloo processes (one per rank).
"""

from __future__ import annotations

import os
import time

import pytest

from dsv4cp.tools.checking import Scenario, compare, run_cp_scenario, run_scenario, summarize

TOL = 1e-5

SINGLE = [Scenario(lens=(n,)) for n in (1, 2, 3, 5, 31, 130)]
MIXED = [
    Scenario(lens=(5, 31, 130), prefix=(0, 3, 17)),
    Scenario(lens=(2, 130), prefix=(1, 60), chunk=13),
    Scenario(lens=(1, 3), prefix=(0, 2), chunk=1),
    Scenario(lens=(31,), prefix=(5,), chunk=7),
    Scenario(lens=(3, 5, 2), chunk=2),
    # its batches (T = 6, then 18) fill CP 2 and 3 with no padding row: the SWA keys are stored
    # rank-major (dense at CP 4 too: the first batch of lens (5, 31, 130), T = 20)
    Scenario(lens=(10, 14), prefix=(0, 6)),
]
SCENARIOS = SINGLE + MIXED


def _id(sc: Scenario) -> str:
    return f"lens{'-'.join(map(str, sc.lens))}_pre{'-'.join(map(str, sc.prefix))}_chunk{sc.chunk}"


_REF: dict[Scenario, dict] = {}


def _reference(sc: Scenario) -> dict:
    if sc not in _REF:
        _REF[sc] = run_scenario(sc)
    return _REF[sc]


def _assert_equal(sc: Scenario, got: dict) -> None:
    rep = summarize(compare(_reference(sc), got), TOL)
    assert not rep["missing"], rep["missing"]
    assert rep["topk_identical"], "top-k sets differ from CP=1"
    assert rep["pass"], rep


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("sc", SCENARIOS, ids=[_id(s) for s in SCENARIOS])
def test_fake_cp_equals_cp1(sc: Scenario, cp: int) -> None:
    got, _ = run_cp_scenario(sc, cp, "fake", timeout_s=60)
    _assert_equal(sc, got)


def test_cp1_through_run_cp_equals_direct() -> None:
    sc = MIXED[0]
    got, _ = run_cp_scenario(sc, 1, "fake")
    _assert_equal(sc, got)


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("sc", SCENARIOS, ids=[_id(s) for s in SCENARIOS])
def test_gloo_processes_equal_cp1(sc: Scenario, cp: int) -> None:
    got, _ = run_cp_scenario(sc, cp, "gloo", timeout_s=60)
    _assert_equal(sc, got)


def _dies_mid_forward(group, sc: Scenario):  # noqa: ANN001 - spawned top-level function
    if group.rank == 1:
        inner = group.all_gather
        count = {"n": 0}

        def gather(x, *, tag):  # noqa: ANN001
            count["n"] += 1
            if count["n"] == 4:  # a few layers in
                os._exit(3)
            return inner(x, tag=tag)

        group.all_gather = gather
    return run_scenario(sc, group)


@pytest.mark.slow
def test_rank_exiting_mid_forward_fails_the_others_within_the_timeout() -> None:
    from dsv4cp.cp.launch import CPLaunchError, spawn_ranks

    t0 = time.monotonic()
    with pytest.raises(CPLaunchError, match="rank 1") as info:
        spawn_ranks(2, _dies_mid_forward, (Scenario(lens=(40,)),), timeout_s=15)
    assert time.monotonic() - t0 < 15 + 10
    # The surviving rank raised itself (it was not merely killed), naming the collective.
    assert info.value.failures[0].startswith("raised CPCommError"), info.value.failures
    assert "all_gather 'layer" in info.value.failures[0]


def test_mismatched_batches_across_ranks_are_rejected() -> None:
    from dsv4cp.cp.launch import run_cp

    with pytest.raises(Exception, match="different batches"):
        run_cp(2, _different_batches, backend="fake")


def _different_batches(group):  # noqa: ANN001
    from dsv4cp.config import DeepseekV41Config
    from dsv4cp.model import DeepseekV41Model
    from dsv4cp.runner import PrefillRunner

    runner = PrefillRunner(DeepseekV41Model(DeepseekV41Config.tiny()), cp=group, num_slots=256)
    return runner.prefill({"a": [1, 2, 3 + group.rank]})


def test_bad_cp_sizes() -> None:
    from dsv4cp.cp.launch import run_cp

    with pytest.raises(ValueError, match="cp_size"):
        run_cp(0, _different_batches, backend="fake")
    with pytest.raises(ValueError, match="cp_size"):
        run_cp(-2, _different_batches, backend="fake")
