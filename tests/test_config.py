"""DeepseekV41Config: parsing the whole released config, presets, layer roles, validation errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from dsv4cp.config import UNUSED_FIELDS, DeepseekV41Config
from dsv4cp.quantization_config import QuantizationConfig
from dsv4cp.roles import LayerRole, layer_roles

FIXTURES = Path(__file__).parent / "fixtures"
FLASH_JSON = FIXTURES / "deepseek-v41-flash-config.json"  # attention fields only
FLASH_REFERENCE_JSON = FIXTURES / "deepseek-v41-flash-inference-config.json"  # flat, whole model
TINY_RELEASED = FIXTURES / "dsv41-tiny-reference" / "checkpoint" / "config.json"


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


# ---------------------------------------------------------------- the whole released config
CONTRACT_FIELDS = (
    "hc_mult",
    "hc_sinkhorn_iters",
    "hc_eps",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "scoring_func",
    "routed_scaling_factor",
    "swiglu_limit",
    "norm_topk_prob",
    "gate_temp",
    "engram_layer_ids",
    "engram_max_ngram_size",
    "engram_vocab_size",
    "engram_n_heads",
    "engram_head_dim",
    "engram_pad_token_id",
    "engram_compressed_vocab_size",
    "engram_num_embeddings",
)


def _as_config_value(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def test_from_hf_reads_the_whole_released_tiny_config() -> None:
    raw = json.loads(TINY_RELEASED.read_text())
    cfg = DeepseekV41Config.from_hf(TINY_RELEASED.parent)
    text = raw["text_config"]
    names = {f.name for f in dataclasses.fields(cfg)}
    assert set(text) <= names and cfg.extra == {}  # every text_config key is a field
    for key, value in text.items():
        if key != "rope_scaling":
            assert getattr(cfg, key) == _as_config_value(value), key
    for name in CONTRACT_FIELDS:
        assert name in text, name
    assert cfg.rope_scaling is not None and cfg.rope_scaling.original_max_position == 32
    assert cfg.quantization == QuantizationConfig(
        weight_block_size=(32, 32), scale_fmt="ue8m0", expert_dtype="fp4"
    )
    assert cfg.vision_config == raw["vision_config"]
    assert cfg.num_nextn_predict_layers == 3 and len(cfg.compress_ratios) == 10
    assert [r.name for r in cfg.layer_roles()][:3] == [
        "swa",
        "r2+kv_source+index_source",
        "r2+reuse_topk",
    ]


def test_unused_fields_are_fields_listed_once() -> None:
    names = {f.name for f in dataclasses.fields(DeepseekV41Config)}
    assert set(UNUSED_FIELDS) <= names and len(set(UNUSED_FIELDS)) == len(UNUSED_FIELDS)
    assert not set(UNUSED_FIELDS) & set(CONTRACT_FIELDS)


def test_attention_only_config_switches_the_other_parts_off() -> None:
    cfg = DeepseekV41Config.from_hf(FLASH_JSON)
    assert (cfg.n_routed_experts, cfg.hc_mult, cfg.engram_layer_ids) == (0, 1, ())
    assert cfg.quantization is None and cfg.vision_config is None
    assert cfg.num_nextn_predict_layers == 0 and cfg.image_token_id is None


# The reference's flat inference/config.json names → HF text_config names (same name if absent).
REFERENCE_NAMES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "moe_inter_dim": "moe_intermediate_size",
    "n_activated_experts": "num_experts_per_tok",
    "score_func": "scoring_func",
    "route_scale": "routed_scaling_factor",
    "rope_head_dim": "qk_rope_head_dim",
    "norm_eps": "rms_norm_eps",
    "window_size": "sliding_window",
    "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id",
    "engram_pad_id": "engram_pad_token_id",
    "n_mtp_layers": "num_nextn_predict_layers",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
}
REFERENCE_ROPE = {
    "rope_factor": "factor",
    "original_seq_len": "original_max_position",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
}
REFERENCE_VISION = {
    "vision_n_layers": "num_hidden_layers",
    "vision_dim": "hidden_size",
    "vision_n_heads": "num_attention_heads",
    "vision_inter_dim": "intermediate_size",
    "vision_patch_size": "patch_size",
    "vision_downsample_ratio": "downsample_ratio",
    "vision_rope_theta": "rope_theta",
}
# Image-preprocessing limits the HF vision_config does not carry.
REFERENCE_NOT_IN_HF = {"vision_max_n_token", "vision_min_pixels", "vision_max_wh_ratio"}


def test_flash_preset_matches_the_reference_inference_config() -> None:
    flat = json.loads(FLASH_REFERENCE_JSON.read_text())
    flash = DeepseekV41Config.flash()
    assert flash.rope_scaling is not None and flash.quantization is not None
    assert flash.vision_config is not None
    for key, value in flat.items():
        if key in REFERENCE_ROPE:
            assert getattr(flash.rope_scaling, REFERENCE_ROPE[key]) == value, key
        elif key in REFERENCE_VISION:
            assert flash.vision_config[REFERENCE_VISION[key]] == value, key
        elif key == "dtype":
            assert flash.quantization.quant_method == value
        elif key == "expert_dtype":
            assert flash.quantization.expert_dtype == value
        elif key not in REFERENCE_NOT_IN_HF:
            name = REFERENCE_NAMES.get(key, key)
            assert getattr(flash, name) == _as_config_value(value), key
    assert flash.gate_temp == 1.0 and flash.norm_topk_prob  # the reference's defaults


def test_to_hf_round_trips_the_released_config() -> None:
    raw = json.loads(TINY_RELEASED.read_text())
    cfg = DeepseekV41Config.from_hf(raw)
    out = cfg.to_hf()
    assert DeepseekV41Config.from_hf(out) == cfg
    for key, value in raw["text_config"].items():
        assert out["text_config"][key] == value, key
    for key in ("quantization_config", "vision_config"):
        assert out[key] == raw[key], key
    extra = DeepseekV41Config.from_hf({**raw["text_config"], "some_future_field": [1, 2]})
    assert extra.extra == {"some_future_field": [1, 2]}
    assert extra.to_hf()["text_config"]["some_future_field"] == [1, 2]


BAD_VALUES = [
    (dict(hidden_size="128"), "hidden_size"),
    (dict(hidden_size=128.0), "hidden_size"),
    (dict(hidden_size=True), "hidden_size"),
    (dict(index_topk=-8), "index_topk"),
    (dict(rope_theta=0), "rope_theta"),
    (dict(rope_theta=-10000.0), "rope_theta"),
    (dict(compress_rope_theta="160000"), "compress_rope_theta"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps"),
    (dict(compress_ratios=(0, 2, 2, 1, 1, "1")), "compress_ratios"),
    (dict(kv_source_layer_ids=(1, 3.0)), "kv_source_layer_ids"),
    (dict(q_head_norm=1), "q_head_norm"),
    (dict(scoring_func="relu"), "scoring_func"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (
        dict(n_routed_experts=8, num_experts_per_tok=9, moe_intermediate_size=64),
        "num_experts_per_tok",
    ),
    (dict(n_routed_experts=8, num_experts_per_tok=2), "moe_intermediate_size"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
    (dict(gate_temp=-1.0), "gate_temp"),
    (dict(swiglu_limit=-1.0), "swiglu_limit"),
    (dict(hc_mult=0), "hc_mult"),
    (dict(hc_sinkhorn_iters=0), "hc_sinkhorn_iters"),
    (dict(engram_layer_ids=(0, 6), engram_num_embeddings=(10, 10)), "engram_layer_ids"),
    (dict(engram_layer_ids=(1, 0), engram_num_embeddings=(10, 10)), "engram_layer_ids"),
    (dict(engram_layer_ids=(0, 1), engram_num_embeddings=(10,)), "engram_num_embeddings"),
    (
        dict(
            engram_layer_ids=(0,),
            engram_num_embeddings=(10,),
            engram_max_ngram_size=3,
            engram_n_heads=2,
            engram_head_dim=32,
            engram_compressed_vocab_size=67,
        ),
        "engram_vocab_size",
    ),
    (
        dict(
            engram_layer_ids=(0,),
            engram_num_embeddings=(10,),
            engram_max_ngram_size=1,
            engram_vocab_size=100,
            engram_n_heads=2,
            engram_head_dim=32,
            engram_compressed_vocab_size=67,
        ),
        "engram_max_ngram_size",
    ),
    (dict(num_nextn_predict_layers=1), "compress_ratios"),
    (dict(dspark_target_layer_ids=(6,)), "dspark_target_layer_ids"),
    (dict(dspark_n_routed_experts=2, dspark_num_experts_per_tok=3), "dspark_num_experts_per_tok"),
    (dict(image_token_id=-1), "image_token_id"),
    (dict(vision_config={"hidden_size": "32"}), "vision_config.hidden_size"),
    (dict(vision_config=[1]), "vision_config"),
]


@pytest.mark.parametrize("change,field", BAD_VALUES, ids=[f for _, f in BAD_VALUES])
def test_bad_values_name_the_field(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"DeepseekV41Config.{field}:"):
        DeepseekV41Config.tiny(**change)


def test_missing_or_bad_rope_fields_name_the_field() -> None:
    text = json.loads(TINY_RELEASED.read_text())["text_config"]
    for key in ("rope_theta", "compress_rope_theta", "qk_rope_head_dim"):
        with pytest.raises(ValueError, match=key):
            DeepseekV41Config.from_hf({k: v for k, v in text.items() if k != key})
    rope = text["rope_scaling"]
    for key in ("factor", "original_max_position_embeddings"):
        with pytest.raises(ValueError, match=f"rope_scaling.{key}: required"):
            DeepseekV41Config.from_hf(
                {**text, "rope_scaling": {k: v for k, v in rope.items() if k != key}}
            )
    for key, value in (
        ("factor", 0),
        ("factor", "16"),
        ("original_max_position_embeddings", 3.5),
        ("beta_fast", None),
    ):
        with pytest.raises(ValueError, match=f"rope_scaling.{key}"):
            DeepseekV41Config.from_hf({**text, "rope_scaling": {**rope, key: value}})
    with pytest.raises(ValueError, match="rope_theta"):
        DeepseekV41Config.from_hf({**text, "rope_theta": 0})


def test_bad_quantization_config_names_the_key() -> None:
    raw = json.loads(TINY_RELEASED.read_text())
    q = raw["quantization_config"]
    for change, key in (
        ({"weight_block_size": [32]}, "weight_block_size"),
        ({"weight_block_size": [32, 0]}, "weight_block_size"),
        ({"scale_fmt": "e4m3"}, "scale_fmt"),
        ({"expert_dtype": "int4"}, "expert_dtype"),
        ({"block": 1}, "unknown keys"),
    ):
        with pytest.raises(ValueError, match=f"quantization_config.*{key}"):
            DeepseekV41Config.from_hf({**raw, "quantization_config": {**q, **change}})


@pytest.mark.parametrize(
    "change,message",
    [
        ({"weight_block_size": [128, 128]}, r"weight_block_size: .*\[32, 32\].*got \[128, 128\]"),
        ({"weight_block_size": [32, 64]}, r"weight_block_size: .*\[32, 32\].*got \[32, 64\]"),
        ({"weight_block_size": [32.0, 32]}, "weight_block_size: must be two positive integers"),
        ({"expert_dtype": None}, r"expert_dtype: must be one of \('fp4',\), got None"),
        ({"expert_dtype": "fp8"}, r"expert_dtype: must be one of \('fp4',\), got 'fp8'"),
    ],
)
def test_quantization_the_loader_cannot_read_is_refused(change: dict, message: str) -> None:
    """The loader reads 32×32 block-scaled fp8 weights and fp4 experts only; other block sizes
    and expert dtypes were accepted and would be read with the wrong scale layout."""
    raw = json.loads(TINY_RELEASED.read_text())
    q = raw["quantization_config"]
    with pytest.raises(ValueError, match=f"quantization_config.{message}"):
        DeepseekV41Config.from_hf({**raw, "quantization_config": {**q, **change}})


def test_roles_module_is_the_config_roles() -> None:
    cfg = DeepseekV41Config.flash()
    roles = layer_roles(
        cfg.layer_ratios,
        cfg.kv_source_layer_ids,
        cfg.index_source_layer_ids,
        cfg.candidate_source_layer_id,
    )
    assert roles == tuple(cfg.layer_roles()) and isinstance(roles[0], LayerRole)
    with pytest.raises(IndexError):
        cfg.layer_role(40)
    with pytest.raises(ValueError, match="^compress_ratios: layer 1 has ratio 4"):
        layer_roles((0, 4), (1,), (1,))
