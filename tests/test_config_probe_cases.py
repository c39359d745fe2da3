"""The reliability probe's config cases (issue 16, part 2a): every value that would make the math
undefined or crash later is a ValueError naming the field, or the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4cp.config import DeepseekV41Config

TINY_RELEASED = (
    Path(__file__).parent / "fixtures" / "dsv41-tiny-reference" / "checkpoint" / "config.json"
)
TEXT = json.loads(TINY_RELEASED.read_text())["text_config"]


def _value(change: dict, field: str) -> object:
    """The bad value, for the case id (a rope_scaling key's, not the whole dict)."""
    top, _, key = field.partition(".")
    v = change[top]
    return v[key] if key else v


CASES = [
    ({"rope_theta": 0.0}, "rope_theta"),
    ({"rope_theta": -10000}, "rope_theta"),
    ({"rope_theta": float("nan")}, "rope_theta"),
    ({"compress_rope_theta": 0}, "compress_rope_theta"),
    ({"hidden_size": "128"}, "hidden_size"),
    ({"hidden_size": 128.0}, "hidden_size"),
    ({"num_hidden_layers": True}, "num_hidden_layers"),
    ({"compress_ratios": "".join(str(r) for r in TEXT["compress_ratios"])}, "compress_ratios"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    ({"index_topk": 10**9, "candidate_source_layer_id": -1}, "index_topk"),
    ({"rope_scaling": {**TEXT["rope_scaling"], "factor": -16}}, "rope_scaling.factor"),
    ({"rope_scaling": [1]}, "rope_scaling"),
    # inf or NaN would crash the forward or silently zero / NaN the logits; a RoPE base ≤ 1 makes
    # YaRN divide by log(theta) = 0 (or flips its band)
    ({"rope_theta": float("inf")}, "rope_theta"),
    ({"rope_theta": 1.0}, "rope_theta"),
    ({"rope_theta": 0.5}, "rope_theta"),
    ({"compress_rope_theta": 1}, "compress_rope_theta"),
    ({"compress_rope_theta": float("inf")}, "compress_rope_theta"),
    ({"rope_theta": 10**400}, "rope_theta"),
    ({"rms_norm_eps": float("inf")}, "rms_norm_eps"),
    ({"hc_eps": float("inf")}, "hc_eps"),
    ({"routed_scaling_factor": float("inf")}, "routed_scaling_factor"),
    ({"routed_scaling_factor": float("-inf")}, "routed_scaling_factor"),
    ({"swiglu_limit": float("inf")}, "swiglu_limit"),
    ({"gate_temp": float("nan")}, "gate_temp"),
    ({"rope_scaling": {**TEXT["rope_scaling"], "factor": float("nan")}}, "rope_scaling.factor"),
    ({"rope_scaling": {**TEXT["rope_scaling"], "factor": float("inf")}}, "rope_scaling.factor"),
    ({"rope_scaling": {**TEXT["rope_scaling"], "factor": 0}}, "rope_scaling.factor"),
    ({"rope_scaling": {**TEXT["rope_scaling"], "beta_fast": 0}}, "rope_scaling.beta_fast"),
    ({"rope_scaling": {**TEXT["rope_scaling"], "beta_fast": -1}}, "rope_scaling.beta_fast"),
    ({"rope_scaling": {**TEXT["rope_scaling"], "beta_slow": 0.0}}, "rope_scaling.beta_slow"),
    (
        {"rope_scaling": {**TEXT["rope_scaling"], "beta_slow": float("nan")}},
        "rope_scaling.beta_slow",
    ),
    (
        {"rope_scaling": {**TEXT["rope_scaling"], "beta_fast": float("inf")}},
        "rope_scaling.beta_fast",
    ),
    ({"rope_scaling": {**TEXT["rope_scaling"], "beta_slow": 1e-320}}, "rope_scaling.beta_slow"),
]


@pytest.mark.parametrize("change,field", CASES, ids=[f"{f}={_value(c, f)!r}" for c, f in CASES])
def test_probe_config_values_name_the_field(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"(DeepseekV41Config\.)?{field}:"):
        DeepseekV41Config.from_hf({**TEXT, **change})


@pytest.mark.parametrize(
    "text,message",
    [
        ("{", "config.json: not valid JSON"),
        ("", "config.json: not valid JSON"),
        ("[1, 2]", "must hold a JSON object, got list"),
        ("null", "must hold a JSON object, got NoneType"),
    ],
)
def test_unreadable_config_json_names_the_file(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        DeepseekV41Config.from_hf(tmp_path)
    if "JSON object" not in message:
        assert str(tmp_path) in str(info.value)


def test_probe_good_values_at_the_edges_load() -> None:
    """The rules' edges: a RoPE base just above 1, eps 0, the betas in either order (DeepSeek's
    yarn code accepts both; the RoPE table is then still finite)."""
    from dsv4cp.ops.rope import rope_inv_freq

    scaling = {**TEXT["rope_scaling"], "beta_fast": 1, "beta_slow": 32}
    cfg = DeepseekV41Config.from_hf(
        {
            **TEXT,
            "rope_theta": 1.5,
            "compress_rope_theta": 1.01,
            "rms_norm_eps": 0,
            "hc_eps": 0,
            "rope_scaling": scaling,
        }
    )
    assert cfg.rope_scaling is not None and cfg.rope_scaling.beta_fast == 1.0
    theta, yarn = cfg.compress_rope(1)
    freq = rope_inv_freq(cfg.qk_rope_head_dim, theta, yarn)
    assert bool(freq.isfinite().all())
