"""The executor choice: made once per forward from the policy, per layer role (CPU: no streams
are created, a lane-less `StreamPool` stands in)."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.config import DeepseekV41Config
from dsv4cp.executors import SERIAL, ExecutorFactory, MultistreamExecutor, StreamPool
from dsv4cp.policy import MultistreamPolicy

ROLES = DeepseekV41Config.tiny().layer_roles()
POOL = StreamPool([], torch.device("cpu"))  # no lanes: nothing touches CUDA


def _multi(executors) -> dict[int, bool]:  # noqa: ANN001
    return {r.layer: isinstance(executors.for_role(r), MultistreamExecutor) for r in ROLES}


def test_auto_uses_streams_only_where_the_policy_and_the_role_pay() -> None:
    auto = ExecutorFactory(MultistreamPolicy(mode="auto"), POOL)
    assert not any(_multi(auto.choose(512, graphs=False)).values())  # eager, few tokens
    picked = _multi(auto.choose(512, graphs=True))
    # every role but the top-k reuse layers: SWA layers and those with a compressor or indexer
    assert picked == {
        r.layer: r.owns_compressor or r.index_source or not r.compressed for r in ROLES
    }
    assert [r.layer for r in ROLES if not picked[r.layer]] == [2, 4]  # the tiny config's reuse
    assert any(picked.values()) and not all(picked.values())
    eager = _multi(auto.choose(8192, graphs=False))  # eager from 8192 local rows
    assert eager == {**picked, 0: False}  # the SWA layer only up to SWA_MAX_TOKENS rows
    assert not any(_multi(auto.choose(8193, graphs=True)).values())  # above the graph bound


def test_forced_modes_and_missing_streams() -> None:
    on = ExecutorFactory(MultistreamPolicy(mode="on"), POOL).choose(4, graphs=False)
    assert all(_multi(on).values())
    off = ExecutorFactory(MultistreamPolicy(mode="off"), POOL).choose(4, graphs=True)
    assert all(off.for_role(r) is SERIAL for r in ROLES)
    no_streams = ExecutorFactory(MultistreamPolicy(mode="on"), None).choose(4, graphs=True)
    assert all(no_streams.for_role(r) is SERIAL for r in ROLES)


def test_gathers_first_and_the_lane_hook_reach_both_executors() -> None:
    def hook(lane: str) -> None:
        pass

    factory = ExecutorFactory(MultistreamPolicy(mode="on"), POOL).with_lane_hook(hook)
    chosen = factory.choose(4, graphs=True, overlap_gathers=False)
    assert chosen.multistream is not None and chosen.multistream.lane_hook is hook
    assert not chosen.serial.overlap_gathers and not chosen.multistream.overlap_gathers
    assert factory.choose(4, graphs=True).serial is SERIAL and SERIAL.overlap_gathers


def test_create_checks_the_device() -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="multistream needs a CUDA device"):
        ExecutorFactory.create(True, device=cpu, lanes=["q"])
    auto = ExecutorFactory.create("auto", device=cpu, lanes=["q"])
    assert auto.streams is None and auto.policy.mode == "auto"
    assert ExecutorFactory.create(False, device=cpu, lanes=["q"]).policy.mode == "off"
