"""The real DeepSeek-V4.1-Flash config built on the meta device: the tensor names the loader reads
against the release's inventory (96,085 tensors in 48 shards, 114 name patterns, 2,334–2,348
tensors per backbone layer: the fixture README).

What is counted: the loader reads every text tensor — embedding, final norm, head, and per layer
the norms, hyper-connections, attention (with the `.scale` of each fp8 weight), MoE (384 fp4
experts × 3 projections × weight + scale, the fp8 shared expert, the gate) and the Engram layers'
projections and tables — and skips by name the 40 `gate.bias_vl` (image-token routing), the
vision tower and the DSpark (`mtp.*`) stages. The skipped groups are counted here from the Flash
config with the name patterns of the fixture checkpoint, which has every pattern of the release.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

from dsv4cp.config import DeepseekV41Config
from dsv4cp.loader import expected_names, skipped_kind
from dsv4cp.model import DeepseekV41Model
from tests.model import dsv41_fixture as fx

RELEASE_TOTAL = 96_085
RELEASE_PATTERNS = 114
PER_LAYER = (2_334, 2_348)


def pattern(name: str) -> str:
    return re.sub(r"\.\d+\.", ".N.", name)


@pytest.fixture(scope="module")
def flash() -> tuple[DeepseekV41Config, set[str]]:
    cfg = DeepseekV41Config.flash()
    model = DeepseekV41Model(cfg, dtype=torch.bfloat16, device="meta", seed=None)
    return cfg, expected_names(model)


def _skipped_counts(cfg: DeepseekV41Config) -> dict[str, int]:
    """The release's skipped tensors at Flash sizes, per fixture pattern."""
    fixture = Counter(pattern(n) for n in fx.names() if skipped_kind(n))
    vision = cfg.vision_config or {}
    out = {"bias_vl": cfg.num_hidden_layers}
    # one tensor per vision block and pattern, one per non-block vision / aligner / image pattern
    blocks = sum(1 for p in fixture if p.startswith("vision.blocks."))
    others = sum(1 for p in fixture if skipped_kind(p) == "vision" and "blocks" not in p) - 1
    out["vision"] = blocks * vision["num_hidden_layers"] + others  # minus the bias_vl pattern
    # DSpark: every stage is a ratio-0 block with dspark_n_routed_experts experts; the first
    # stage adds main_proj (+scale) and main_norm, the last norm and the two DSpark heads.
    per_stage = [p for p in fixture if p.startswith("mtp.N.") and fixture[p] >= 3]
    experts = [p for p in per_stage if ".experts." in p]
    stage = len(per_stage) - len(experts) + len(experts) * cfg.dspark_n_routed_experts
    once = sum(1 for p in fixture if p.startswith("mtp.") and fixture[p] < 3)
    out["DSpark"] = cfg.num_nextn_predict_layers * stage + once
    return out


def test_flash_names_against_the_release_inventory(flash) -> None:
    cfg, names = flash
    assert len(names) == 93_378
    skipped = _skipped_counts(cfg)
    assert skipped == {"bias_vl": 40, "vision": 266, "DSpark": 2_401}
    assert len(names) + sum(skipped.values()) == RELEASE_TOTAL


def test_flash_per_layer_counts(flash) -> None:
    cfg, names = flash
    per_layer = Counter(int(n.split(".")[1]) for n in names if n.startswith("layers."))
    assert sorted(per_layer) == list(range(cfg.num_hidden_layers))
    with_bias_vl = {i: c + 1 for i, c in per_layer.items()}  # + the skipped gate.bias_vl
    assert (min(with_bias_vl.values()), max(with_bias_vl.values())) == PER_LAYER
    assert with_bias_vl[14] == PER_LAYER[1]  # kv + index source, ratio 2, Engram
    assert with_bias_vl[0] == PER_LAYER[0]  # window-only layer
    experts = sum(1 for n in names if n.startswith("layers.2.ffn.experts."))
    assert experts == cfg.n_routed_experts * 3 * 2
    tables = {n for n in names if ".engram.embed." in n}
    assert tables == {f"layers.{i}.engram.embed.{s}" for i in (1, 14) for s in ("weight", "scale")}


def test_flash_patterns_are_the_fixtures_text_patterns(flash) -> None:
    _, names = flash
    fixture = {pattern(n) for n in fx.names()}
    assert len(fixture) == RELEASE_PATTERNS
    ours = {pattern(n) for n in names}
    assert ours == {p for p in fixture if not skipped_kind(p)}
