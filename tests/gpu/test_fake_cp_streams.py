"""Fake CP ranks capturing graphs at the same time never share a side stream (issue 16, item 8):
`dsv4cp check --device cuda --cp 8 --cp-backend fake --multistream --graphs` passes (it failed
with "operation would result in a merge of separate capture sequences", and aborted with
"Cannot register the state during capturing stage" at --prefix 200); with only torch's stream
pool (DSV4CP_SIDE_STREAMS=pool) CP 8 is refused up front in one line and CP 4 passes."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4cp.config import DeepseekV41Config
from dsv4cp.cp.launch import run_cp
from dsv4cp.graphs.runner import GraphConfig
from dsv4cp.model import DeepseekV41Model
from dsv4cp.runner import PrefillRunner
from dsv4cp.side_streams import side_stream_mode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROOT = Path(__file__).resolve().parents[2]


def _check(*extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # A child process: the failure this guards against aborted the interpreter (rc 134).
    argv = [sys.executable, "-m", "dsv4cp", "check", "--device", "cuda", "--cp-backend", "fake"]
    argv += ["--multistream", "--graphs", "--json", *extra]
    return subprocess.run(
        argv,
        env={**os.environ, "PYTHONPATH": str(ROOT / "python"), **(env or {})},
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_dedicated_streams_are_available() -> None:
    assert side_stream_mode() in ("runtime", "driver")


@pytest.mark.parametrize("prefix", ["0", "200"])
def test_check_cp8_fake_multistream_graphs(prefix: str) -> None:
    proc = _check("--cp", "8", "--lens", "300", "--prefix", prefix)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert out["pass"] and set(out["variants"]) == {
        "serial",
        "multistream",
        "graphs",
        "multistream+graphs",
    }


def test_pool_only_refuses_cp8_and_runs_cp4() -> None:
    proc = _check("--cp", "8", "--lens", "300", env={"DSV4CP_SIDE_STREAMS": "pool"})
    assert proc.returncode == 2, proc.stderr[-4000:]
    # refused before the CP=1 reference runs
    assert "needs 40 side streams on cuda:0 and torch's pool has 32" in proc.stderr
    assert "[1/2]" not in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _check("--cp", "4", "--lens", "300", env={"DSV4CP_SIDE_STREAMS": "pool"})
    assert proc.returncode == 0, proc.stderr[-4000:]


def _stream_handles(group) -> list[int]:  # noqa: ANN001
    model = DeepseekV41Model(DeepseekV41Config.tiny(), device="cuda", seed=0)
    gcfg = GraphConfig(buckets=(16, 64), max_requests=2, max_context=64)
    runner = PrefillRunner(model, cp=group, multistream=True, num_slots=512, graphs=gcfg)
    lanes = runner.executors.streams
    assert lanes is not None and runner.graph_runner is not None
    capture = runner.graph_runner.capture_stream
    assert capture is not None
    return [s.cuda_stream for s in lanes.streams.values()] + [capture.cuda_stream]


def test_every_rank_has_its_own_streams() -> None:
    handles = [h for rank in run_cp(8, _stream_handles, backend="fake") for h in rank]
    assert len(handles) == 8 * 5 and len(set(handles)) == len(handles)


def test_a_dropped_runner_frees_its_streams() -> None:
    # torch's stream objects never run weakref callbacks: the registry releases on the owner.
    from dsv4cp.cp.group import SingleCPGroup
    from dsv4cp.side_streams import _get_registry

    reg, dev = _get_registry(), torch.cuda.current_device()
    before = reg.held(dev)
    model = DeepseekV41Model(DeepseekV41Config.tiny(), device="cuda", seed=0)
    gcfg = GraphConfig(buckets=(16,), max_requests=2, max_context=64)
    runner = PrefillRunner(model, cp=SingleCPGroup(), multistream=True, num_slots=512, graphs=gcfg)
    assert runner.executors.streams is not None
    assert reg.held(dev) == before + len(runner.executors.streams.streams) + 1  # + capture
    del runner
    gc.collect()
    assert reg.held(dev) == before
