"""benchmarks/model_layers.py: the CPU smoke run (table, JSON, path check) and its formulas."""

from __future__ import annotations

import json

from benchmarks.model_layers import layer_subset_config, main, moe_gemm_flops, split_stages


def test_smoke_run_writes_the_report(tmp_path, capsys) -> None:
    out = tmp_path / "ml.json"
    assert main(["--smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["paths"]["equal_up_to_bf16"] is True
    assert [r["tokens"] for r in report["rows"]] == [64, 192]
    for row in report["rows"]:
        assert row["moe_ms"] > 0 and row["mhc_ms"] > 0 and row["attention_ms"] > 0
    assert "tok_per_s" in capsys.readouterr().out


def test_flash_subset_has_every_role_and_the_released_block() -> None:
    cfg = layer_subset_config()
    assert cfg.n_routed_experts == 384 and cfg.num_experts_per_tok == 6 and cfg.hc_mult == 4
    assert len({r.name for r in cfg.layer_roles()}) == 6
    dense = layer_subset_config(blocks=False)
    assert dense.n_routed_experts == 0 and dense.hc_mult == 1


def test_moe_flops_and_stage_split() -> None:
    cfg = layer_subset_config()
    assert moe_gemm_flops(cfg, 1) == 6 * 2 * 3 * 5120 * 2304 * 7
    split = split_stages([("moe", 5.0, 6), ("mhc", 1.0, 12), ("q_chain", 2.0, 6)], 10.0)
    assert split == {"attention_ms": 2.0, "moe_ms": 5.0, "mhc_ms": 1.0, "other_ms": 2.0}
