"""benchmarks/layer_peer.py --smoke: the benchmark script end to end on the CPU (tiny config)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import layer_peer


def test_smoke_run_writes_rows_cp_rows_and_targets(tmp_path: Path) -> None:
    out = tmp_path / "peer.json"
    argv = ["--smoke", "--cases", "chunk32@80", "--iters", "2", "--target-s", "0.001"]
    assert layer_peer.main([*argv, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [r["layer"] for r in rows] == list(layer_peer.SMOKE_LAYERS)
    assert all("error" not in r for r in rows), [r.get("error") for r in rows]
    for r in rows:
        assert r["dsv4cp_ms"] > 0 and r["peer_ms"] > 0 and r["floor_ms"] > 0
        assert r["speedup_vs_peer"] == r["peer_ms"] / r["dsv4cp_ms"]
    index_rows = [r for r in rows if r["dsv4cp_indexer"] != "-"]
    assert len(index_rows) == 3
    assert all(r["fused_rows_identical"] == 1.0 for r in index_rows)  # the ops twins on the CPU
    assert {r["cp"] for r in doc["cp_rows"]} == {2}
    assert all("rank_over_ideal" in r for r in doc["cp_rows"])
    assert doc["targets"] and doc["config"] == "tiny" and doc["quant"] == "qat"
    assert all(r["attn_layer_ms"] > 0 for r in rows)


def test_unknown_case_is_refused(tmp_path: Path) -> None:
    assert layer_peer.main(["--smoke", "--cases", "nope", "--out", str(tmp_path / "x.json")]) == 2
