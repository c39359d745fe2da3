"""benchmarks/forward_mix.py: a forward's per-rank attention time from layer_peer's CP rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks import forward_mix, layer_peer_setup

from dsv4cp.config import DeepseekV41Config

FLASH = DeepseekV41Config.flash()


def _row(layer: int, rank: float, ideal: float, cp: int = 8, **kw: float) -> dict:
    return dict(
        case="chunk16k@112k", cp=cp, layer=layer, rank_ms=rank, ideal_ms=ideal,
        rank_over_ideal=rank / ideal, **kw,
    )  # fmt: skip


def test_every_flash_layer_maps_to_its_roles_measured_layer() -> None:
    reps = forward_mix.representatives(FLASH, list(layer_peer_setup.LAYERS))
    assert len(reps) == FLASH.num_hidden_layers == 40
    counts = {i: list(reps.values()).count(i) for i in layer_peer_setup.LAYERS}
    assert counts == {0: 1, 1: 1, 2: 3, 3: 15, 20: 1, 21: 15, 24: 4}
    assert reps[8] == reps[14] == 2 and reps[36] == 24 and reps[39] == 21 and reps[19] == 3


def test_a_role_nobody_measured_is_named() -> None:
    with pytest.raises(ValueError, match=r"layers \[24, 28, 32, 36\]"):
        forward_mix.representatives(FLASH, [0, 1, 2, 3, 20, 21])
    with pytest.raises(ValueError, match=r"layers \[0\]"):  # the first layer is its own role
        forward_mix.representatives(FLASH, [1, 2, 3, 20, 21, 24])


def test_the_sum_weights_each_layer_by_its_count_and_prefers_auto() -> None:
    rows = [_row(i, 1.0 + i, 1.0 + i) for i in (1, 2, 3, 20, 21, 24)]
    rows.append(_row(0, 3.0, 1.0, auto_rank_ms=2.0))  # judged on the auto executor's time
    (mix,) = forward_mix.forward_mix(FLASH, rows)
    ideal = 1 + 2 + 3 * 3 + 15 * 4 + 21 + 15 * 22 + 4 * 25
    assert mix["ideal_ms"] == pytest.approx(ideal)
    assert mix["rank_ms"] == pytest.approx(ideal - 1 + 2)  # layer 0: auto 2.0 over ideal 1.0
    assert mix["rank_over_ideal"] == pytest.approx((ideal + 1) / ideal)
    assert mix["excess_ms_by_layer"]["0"] == pytest.approx(1.0)
    assert mix["largest_excess_layer"] == 0 and "error" not in mix


def test_groups_are_per_case_and_cp_and_a_partial_group_is_an_error() -> None:
    rows = [_row(i, 2.0, 1.0, cp=4) for i in layer_peer_setup.LAYERS]
    rows += [_row(i, 2.0, 1.0, cp=8) for i in (0, 1, 2)]
    rows.append(dict(case="chunk16k@112k", cp=8, layer=3, error="time budget"))
    four, eight = forward_mix.forward_mix(FLASH, rows)
    assert four["cp"] == 4 and four["rank_over_ideal"] == pytest.approx(2.0)
    assert eight["cp"] == 8 and "no measured layer" in eight["error"]


def test_the_cli_reads_a_results_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = tmp_path / "peer.json"
    rows = [_row(i, 1.1, 1.0) for i in layer_peer_setup.LAYERS]
    src.write_text(json.dumps({"config": "flash", "cp_rows": rows}))
    out = tmp_path / "mix.json"
    assert forward_mix.main([str(src), "--out", str(out)]) == 0
    (mix,) = json.loads(out.read_text())["rows"]
    assert mix["rank_over_ideal"] == pytest.approx(1.1)
    assert "1.100" in capsys.readouterr().out
    assert forward_mix.main([str(tmp_path / "missing.json")]) == 2
    src.write_text(json.dumps({"config": "flash", "cp_rows": []}))
    assert forward_mix.main([str(src)]) == 2
