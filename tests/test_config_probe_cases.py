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
]


@pytest.mark.parametrize(
    "change,field", CASES, ids=[f"{f}={list(c.values())[0]!r}" for c, f in CASES]
)
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
