"""benchmarks/layer_peer.py --smoke: the benchmark script end to end on the CPU (tiny config)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from benchmarks import layer_peer, layer_peer_cp, layer_peer_setup

from dsv4cp.config import DeepseekV41Config
from dsv4cp.executors import StreamPool


def test_smoke_run_writes_rows_cp_rows_and_targets(tmp_path: Path) -> None:
    out = tmp_path / "peer.json"
    argv = ["--smoke", "--cases", "chunk32@80", "--iters", "2", "--target-s", "0.001"]
    assert layer_peer.main([*argv, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [r["layer"] for r in rows] == list(layer_peer_setup.SMOKE_LAYERS)
    assert all("error" not in r for r in rows), [r.get("error") for r in rows]
    for r in rows:
        assert r["dsv4cp_ms"] > 0 and r["peer_ms"] > 0 and r["floor_ms"] > 0
        assert r["speedup_vs_peer"] == r["peer_ms"] / r["dsv4cp_ms"]
    index_rows = [r for r in rows if r["dsv4cp_indexer"] != "-"]
    assert len(index_rows) == 3
    assert all(r["fused_rows_identical"] == 1.0 for r in index_rows)  # the ops twins on the CPU
    assert {r["cp"] for r in doc["cp_rows"]} == {2}
    assert all("rank_over_ideal" in r for r in doc["cp_rows"])
    for r in doc["cp_rows"]:  # one repeat: the first pass's and the repeat's CP 1 samples
        assert len(r["cp1_samples_ms"]) == 2 and len(r["rank_samples_ms"]) == 1
        assert r["rank_over_ideal_min"] == r["rank_over_ideal_max"] == r["rank_over_ideal"]
    assert doc["targets"] and doc["config"] == "tiny" and doc["quant"] == "qat"
    assert all(r["attn_layer_ms"] > 0 for r in rows)
    (mix,) = doc["forward_mix"]  # the tiny config's six layers are its six measured roles
    assert mix["cp"] == 2 and mix["counts"] == {str(i): 1 for i in layer_peer_setup.SMOKE_LAYERS}
    rank = sum(r.get("auto_rank_ms", r["rank_ms"]) for r in doc["cp_rows"])
    assert mix["rank_ms"] == pytest.approx(rank)
    assert mix["ideal_ms"] == pytest.approx(sum(r["ideal_ms"] for r in doc["cp_rows"]))


def test_cp_repeats_give_the_median_and_the_spread(tmp_path: Path) -> None:
    out = tmp_path / "peer.json"
    argv = ["--smoke", "--cases", "chunk32@80", "--layers", "0,1", "--no-peer", "--iters", "2"]
    argv += ["--target-s", "0.001", "--cp-repeats", "3", "--out", str(out)]
    assert layer_peer.main(argv) == 0
    cp_rows = json.loads(out.read_text())["cp_rows"]
    assert [r["layer"] for r in cp_rows] == [0, 1]
    for r in cp_rows:
        ranks, cp1 = r["rank_samples_ms"], r["cp1_samples_ms"]
        assert len(ranks) == 3 and len(cp1) == 4 and len(r["rank_over_ideal_repeats"]) == 3
        assert r["rank_ms"] == sorted(ranks)[1] and r["cp1_ms"] == pytest.approx(sum(cp1) / 4)
        assert r["rank_over_ideal"] == r["rank_ms"] / (r["cp1_ms"] / 2)
        assert r["rank_over_ideal_min"] <= r["rank_over_ideal_max"]
        # the CPU has no streams: `auto` runs the serial executor, timed in every repeat
        serial = sorted(t["serial"] for t in r["rank_ms_by_executor"])
        assert r["auto_executor"] == "serial" and r["auto_rank_ms"] == serial[1]
        assert r["auto_rank_over_ideal"] == r["auto_rank_ms"] / (r["cp1_ms"] / 2)
    assert layer_peer.main([*argv[:-4], "--cp-repeats", "0", "--out", str(out)]) == 2


def test_auto_executor_is_the_policy_pick_inside_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsv4cp.config import DeepseekV41Config

    monkeypatch.delenv("DSV4CP_MULTISTREAM", raising=False)
    monkeypatch.delenv("DSV4CP_MULTISTREAM_MAX_TOKENS", raising=False)
    roles = DeepseekV41Config.tiny().layer_roles()  # swa, r2 source, r2 reuse, ...
    streams = StreamPool([], torch.device("cpu"))  # no lanes: stands in for CUDA streams
    picks = [layer_peer_cp.auto_executor(r, 2048, streams) for r in roles]
    assert picks == ["multistream", "multistream", "serial", "multistream", "serial", "multistream"]
    assert layer_peer_cp.auto_executor(roles[1], 16384, streams) == "serial"  # above 8192
    assert layer_peer_cp.auto_executor(roles[1], 2048, None) == "serial"
    monkeypatch.setenv("DSV4CP_MULTISTREAM", "off")
    assert layer_peer_cp.auto_executor(roles[1], 2048, streams) == "serial"


def test_unknown_case_is_refused(tmp_path: Path) -> None:
    assert layer_peer.main(["--smoke", "--cases", "nope", "--out", str(tmp_path / "x.json")]) == 2


@pytest.mark.parametrize(
    ("layers", "says"),
    [
        ("4,5", "layer 4 reads what layer(s) [3] publish"),
        ("3,5,4", "in model order"),
        ("3,3", "in model order"),
        ("0,9", "[9] are not layers of the config (0..5)"),
        ("zero", "a comma list of layer ids"),
    ],
)
def test_a_layer_list_that_cannot_run_is_refused_before_any_work(
    layers: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "peer.json"
    assert layer_peer.main(["--smoke", "--layers", layers, "--out", str(out)]) == 2
    assert says in capsys.readouterr().err and not out.exists()


def test_the_flash_lists_name_what_each_layer_reads() -> None:
    flash = DeepseekV41Config.flash()
    problem = layer_peer_setup.layer_list_problem
    assert problem(flash, "0,1,2,3,20,21,24") is None
    assert "layer 24 reads what layer(s) [20]" in str(problem(flash, "24"))
    assert "layer 21 reads what layer(s) [20]" in str(problem(flash, "21,24"))
    assert problem(flash, "20,21,24") is None
    assert "layer 9 reads what layer(s) [8]" in str(problem(flash, "2,9"))
