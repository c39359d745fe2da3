"""DeepseekV41Config: parsing, presets, layer roles and validation errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4cp.config import DeepseekV41Config

FLASH_JSON = (
    Path(__file__).parent / "data" / "deepseek-v41-flash-config.json"
)  # copy of shared/data


def test_from_hf_reads_dict_file_dir_nested_and_flat(tmp_path: Path) -> None:
    raw = json.loads(FLASH_JSON.read_text())
    a = DeepseekV41Config.from_hf(FLASH_JSON)
    b = DeepseekV41Config.from_hf(raw)
    c = DeepseekV41Config.from_hf(raw["text_config"])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    d = DeepseekV41Config.from_hf(tmp_path)
    assert a == b == c == d
    assert a.hidden_size == 5120 and a.index_n_heads == 32 and a.rms_norm_eps == 1e-20
    assert a.rope_scaling is not None and a.rope_scaling.factor == 16
    assert a.candidate_source_layer_id == 20 and a.candidate_block_size == 8


def test_flash_preset_matches_the_real_config() -> None:
    real = DeepseekV41Config.from_hf(FLASH_JSON)
    flash = DeepseekV41Config.flash()
    for name in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "head_dim",
        "qk_rope_head_dim",
        "q_lora_rank",
        "o_lora_rank",
        "o_groups",
        "sliding_window",
        "rms_norm_eps",
        "rope_theta",
        "compress_rope_theta",
        "rope_scaling",
        "index_n_heads",
        "index_head_dim",
        "index_topk",
        "compress_ratios",
        "kv_source_layer_ids",
        "index_source_layer_ids",
        "candidate_source_layer_id",
        "candidate_topk_blocks",
        "candidate_block_size",
        "vocab_size",
    ):
        assert getattr(flash, name) == getattr(real, name), name


def test_to_hf_round_trip() -> None:
    for cfg in (DeepseekV41Config.tiny(), DeepseekV41Config.flash()):
        assert DeepseekV41Config.from_hf(cfg.to_hf()) == cfg


def test_flash_layer_roles() -> None:
    cfg = DeepseekV41Config.flash()
    r = cfg.layer_role
    assert r(0).ratio == 0 and r(1).ratio == 0 and r(0).kv_source is None
    assert (r(2).ratio, r(2).owns_compressor, r(2).index_source, r(2).topk_from) == (
        2,
        True,
        True,
        2,
    )
    assert (r(3).kv_source, r(3).index_source, r(3).topk_from) == (2, False, 2)
    assert (r(9).kv_source, r(9).topk_from) == (8, 8)
    assert r(20).candidate_source and r(20).owns_compressor and r(20).ratio == 1
    assert (r(21).kv_source, r(21).topk_from, r(21).candidate_consumer) == (20, 20, False)
    assert r(24).candidate_consumer and r(24).kv_source == 20 and not r(24).owns_compressor
    assert (r(25).topk_from, r(39).topk_from) == (24, 36)
    assert r(19).kv_source == 14 and r(19).topk_from == 14


def test_tiny_layer_roles() -> None:
    cfg = DeepseekV41Config.tiny()
    names = [cfg.layer_role(i).name for i in range(cfg.num_hidden_layers)]
    assert names == [
        "swa",
        "r2+kv_source+index_source",
        "r2+reuse_topk",
        "r1+kv_source+candidate_source",
        "r1+reuse_topk",
        "r1+candidate_consumer",
    ]


BAD = [
    (dict(compress_ratios=(0, 4, 2, 1, 1, 1)), "compress_ratios"),
    (dict(kv_source_layer_ids=(0, 3)), "kv_source_layer_ids"),
    (dict(o_groups=3), "o_groups"),
    (dict(index_topk=64), "index_topk"),
    (dict(index_source_layer_ids=(3, 5)), "index_source_layer_ids"),
    (dict(candidate_source_layer_id=4), "candidate_source_layer_id"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(compress_ratios=(0, 2)), "compress_ratios"),
]


@pytest.mark.parametrize("change,field", BAD, ids=[f for _, f in BAD])
def test_bad_configs_name_the_field(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        DeepseekV41Config.tiny(**change)


def test_missing_fields_and_bad_rope_scaling() -> None:
    raw = json.loads(FLASH_JSON.read_text())["text_config"]
    with pytest.raises(ValueError, match="index_topk"):
        DeepseekV41Config.from_hf({k: v for k, v in raw.items() if k != "index_topk"})
    with pytest.raises(ValueError, match="rope_scaling"):
        DeepseekV41Config.from_hf({**raw, "rope_scaling": {"type": "linear", "factor": 2}})
    with pytest.raises(FileNotFoundError):
        DeepseekV41Config.from_hf("/nonexistent/dir")
