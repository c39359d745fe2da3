"""save_pretrained / from_pretrained: DeepSeek weight names, exact round trip, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4cp.config import DeepseekV41Config
from dsv4cp.model import WEIGHTS_FILE, DeepseekV41Model
from dsv4cp.runner import PrefillRunner


def test_round_trip_gives_identical_logits(tmp_path: Path) -> None:
    cfg = DeepseekV41Config.tiny()
    model = DeepseekV41Model(cfg, seed=4)
    model.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["DeepseekV41ForCausalLM"] and "text_config" in raw
    names = set(load_file(tmp_path / WEIGHTS_FILE))
    for n in (
        "layers.1.attn.wq_a.weight",
        "layers.1.attn.wkv.weight",
        "layers.1.attn.attn_sink",
        "layers.1.attn.compressor.wkv.weight",
        "layers.1.attn.compressor.wgate.weight",
        "layers.3.attn.indexer.wk.weight",
        "layers.5.attn.indexer.weights_proj.weight",
        "embed.weight",
        "head.weight",
        "norm.weight",
    ):
        assert n in names, n
    assert "layers.3.attn.compressor.wgate.weight" not in names  # ratio 1: no gate
    assert "layers.5.attn.compressor.wkv.weight" not in names  # not a kv source
    again = DeepseekV41Model.from_pretrained(tmp_path)
    prompt = torch.randint(0, cfg.vocab_size, (50,), generator=torch.Generator().manual_seed(0))
    a = PrefillRunner(model, num_slots=256).prefill({"p": prompt.tolist()}).logits
    b = PrefillRunner(again, num_slots=256).prefill({"p": prompt.tolist()}).logits
    assert torch.equal(a, b)


def test_mismatched_checkpoints_are_rejected(tmp_path: Path) -> None:
    model = DeepseekV41Model(DeepseekV41Config.tiny(), seed=0)
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / WEIGHTS_FILE)
    del tensors["layers.2.attn.wq_b.weight"]
    tensors["layers.2.attn.bogus"] = torch.zeros(1)
    save_file(tensors, tmp_path / WEIGHTS_FILE)
    with pytest.raises(ValueError, match="missing.*wq_b.*unexpected.*bogus"):
        DeepseekV41Model.from_pretrained(tmp_path)


def test_quant_modes_not_there_yet_raise() -> None:
    with pytest.raises(NotImplementedError):
        DeepseekV41Model(DeepseekV41Config.tiny(), quant="sglang_v4_layout")
    with pytest.raises(ValueError, match="unknown quant mode"):
        DeepseekV41Model(DeepseekV41Config.tiny(), quant="int3")


def test_qat_export_reloads_as_qat(tmp_path: Path) -> None:
    """A quantized export (quantization_config, fp8/fp4 storage) reloads with its own numerics:
    from_pretrained's quant defaults to qat there, "none" elsewhere, and can be asked for."""
    cfg = DeepseekV41Config.tiny_full(quantization=DeepseekV41Config.flash().quantization)
    model = DeepseekV41Model(cfg, seed=3, quant="qat", dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    again = DeepseekV41Model.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert again.quant == "qat"
    prompt = list(range(1, 40))
    a = PrefillRunner(model, num_slots=256).prefill({"p": prompt}).logits
    b = PrefillRunner(again, num_slots=256).prefill({"p": prompt}).logits
    assert torch.equal(a, b)
    plain = DeepseekV41Model.from_pretrained(tmp_path, dtype=torch.bfloat16, quant="none")
    assert plain.quant == "none"
    dense = tmp_path / "dense"
    DeepseekV41Model(DeepseekV41Config.tiny(), seed=0).save_pretrained(dense)
    assert DeepseekV41Model.from_pretrained(dense).quant == "none"


def test_an_export_and_a_released_checkpoint_are_told_apart(tmp_path: Path) -> None:
    """config.json's model_type names the kind: an export loads only with from_pretrained, a
    released checkpoint only with from_checkpoint, and `accuracy`'s Reference picks the loader
    by it (it took a save_pretrained export, then model_type deepseek_v41, for a released one
    and failed on the missing `.scale` tensors)."""
    from dsv4cp.checkpoint import CheckpointError
    from dsv4cp.config import checkpoint_kind
    from dsv4cp.tools.accuracy import Reference

    export = tmp_path / "export"
    DeepseekV41Model(DeepseekV41Config.tiny(), seed=0).save_pretrained(export)
    assert json.loads((export / "config.json").read_text())["model_type"] == "dsv4cp_v41"
    assert checkpoint_kind(export) == "export"
    with pytest.raises(CheckpointError, match="dsv4cp export.*from_pretrained"):
        DeepseekV41Model.from_checkpoint(export, quant="none")
    assert Reference(export).model.quant == "none"

    released = tmp_path / "released"
    released.mkdir()
    (released / "config.json").write_text(json.dumps(DeepseekV41Config.tiny().to_hf()))
    assert checkpoint_kind(released) == "released"
    with pytest.raises(ValueError, match="released DeepSeek-V4.1 checkpoint.*from_checkpoint"):
        DeepseekV41Model.from_pretrained(released)

    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="'llama' is neither"):
        checkpoint_kind(other)
    with pytest.raises(CheckpointError, match="'llama' is neither"):
        DeepseekV41Model.from_checkpoint(other)
    (other / "config.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(ValueError, match="not valid JSON"):
        checkpoint_kind(other)
