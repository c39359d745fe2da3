"""`load_checkpoint` / `DeepseekV41Model.from_checkpoint` on the tiny released-format fixture:
every text tensor read, vision and DSpark skipped by name (said once), Engram tables memmapped,
a strict name check, and bad checkpoints refused with the tensor and file named."""

from __future__ import annotations

import json
import logging
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from dsv4cp.checkpoint import CheckpointError, CheckpointReader
from dsv4cp.config import DeepseekV41Config
from dsv4cp.loader import expected_names, load_checkpoint, nonfinite, skipped_kind
from dsv4cp.model import DeepseekV41Model
from tests.checkpoint.corrupt import edit_header, edit_index, shard_of
from tests.model import dsv41_fixture as fx


def _fresh(dtype: torch.dtype = torch.bfloat16) -> DeepseekV41Model:
    return DeepseekV41Model(DeepseekV41Config.from_hf(fx.CHECKPOINT), dtype=dtype, seed=None)


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(fx.CHECKPOINT, dst)
    return dst


def test_every_text_tensor_is_read_and_the_rest_skipped_once(caplog) -> None:
    model = _fresh()
    with caplog.at_level(logging.INFO, logger="dsv4cp.loader"):
        report = load_checkpoint(model, fx.CHECKPOINT)
    names = set(fx.names())
    skipped = {n for v in report.skipped.values() for n in v}
    assert {k: len(v) for k, v in report.skipped.items()} == {"DSpark": 169, "vision": 25}
    assert all(n.startswith("mtp.") for n in report.skipped["DSpark"])
    assert {n for n in report.skipped["vision"] if n.startswith("layers.")} == {
        f"layers.{i}.ffn.gate.bias_vl" for i in range(7)
    }
    assert expected_names(model) | skipped == names  # nothing read twice, nothing left out
    assert not expected_names(model) & skipped
    lines = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(lines) == 1 and "25 vision" in lines[0] and "169 DSpark" in lines[0]
    assert len([r for r in caplog.records if "loaded block" in r.getMessage()]) == 7


def test_weights_equal_the_checkpoint() -> None:
    model = DeepseekV41Model.from_checkpoint(fx.CHECKPOINT, quant="none", dtype=torch.bfloat16)
    slots = model.checkpoint_weights()
    reader = fx.reader()
    for name in ("embed.weight", "layers.3.ffn.experts.5.w2.weight", "layers.1.hc_ffn_fn"):
        stored = reader.get(name)
        assert torch.equal(slots[name].view(torch.uint8), stored.view(torch.uint8)), name
    assert slots["head.weight"].dtype == torch.float32  # widened exactly from bf16
    assert torch.equal(slots["head.weight"], reader.get("head.weight").float())


def test_engram_tables_stay_memmaps() -> None:
    model = DeepseekV41Model.from_checkpoint(fx.CHECKPOINT, quant="none")
    for engram in model.engram_layers:
        assert engram.table is not None
        assert all(isinstance(t, np.memmap) for t in engram.table)
    assert model.engram_hashes is not None


def test_skip_rules() -> None:
    assert skipped_kind("vision.blocks.0.attn.wqkv.weight") == "vision"
    assert skipped_kind("aligner.w1.bias") == "vision"
    assert skipped_kind("image_newline") == "vision"
    assert skipped_kind("layers.3.ffn.gate.bias_vl") == "vision"
    assert skipped_kind("mtp.2.ffn.experts.1.w1.weight") == "DSpark"
    assert skipped_kind("layers.3.ffn.gate.bias") is None


def test_missing_and_unexpected_tensors_are_listed(tmp_path) -> None:
    root = _copy(tmp_path)
    gone, renamed = "layers.2.attn_norm.weight", "layers.2.attn.mystery.weight"
    edit_index(root, lambda wm: wm.__setitem__(renamed, wm.pop(gone)))
    shard = shard_of(root, renamed)
    edit_header(shard, lambda h: h.__setitem__(renamed, h.pop(gone)))
    with pytest.raises(CheckpointError) as err:
        DeepseekV41Model.from_checkpoint(root, quant="none")
    msg = str(err.value)
    assert f"missing (1): {gone}" in msg
    assert f"unexpected: {renamed!r} in {shard}" in msg


def _poke(root: Path, name: str, value: bytes) -> Path:
    """Overwrite the first bytes of tensor `name` in its shard."""
    spec = CheckpointReader(root).spec(name)
    raw = bytearray(Path(spec.file).read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    begin = 8 + n + json.loads(raw[8 : 8 + n])[name]["data_offsets"][0]
    raw[begin : begin + len(value)] = value
    Path(spec.file).write_bytes(bytes(raw))
    return Path(spec.file)


BAD_VALUES = [
    ("layers.4.ffn_norm.weight", struct.pack("<H", 0x7FC0)),  # bf16 NaN
    ("layers.0.hc_attn_base", struct.pack("<f", float("inf"))),  # fp32 inf
    ("layers.5.attn.wq_b.weight", b"\x7f"),  # fp8 e4m3 NaN code
    ("layers.6.ffn.experts.1.w3.scale", b"\xff"),  # e8m0 NaN
]


@pytest.mark.parametrize("name,value", BAD_VALUES, ids=[n for n, _ in BAD_VALUES])
def test_non_finite_weights_are_refused(tmp_path, name: str, value: bytes) -> None:
    root = _copy(tmp_path)
    shard = _poke(root, name, value)
    with pytest.raises(CheckpointError) as err:
        DeepseekV41Model.from_checkpoint(root, quant="none")
    assert repr(name) in str(err.value) or name in str(err.value)
    assert str(shard) in str(err.value)


def test_nonfinite_counts_every_storage() -> None:
    assert nonfinite(torch.tensor([1.0, float("nan"), float("-inf")])) == 2
    assert (
        nonfinite(torch.tensor([0x7F, 0xFF, 0x7E], dtype=torch.uint8).view(torch.float8_e4m3fn))
        == 2
    )
    assert nonfinite(torch.tensor([0xFF, 127], dtype=torch.uint8).view(torch.float8_e8m0fnu)) == 1
    assert nonfinite(torch.tensor([-1, 127], dtype=torch.int8)) == 0


def test_wrong_dtype_and_shape_name_the_tensor(tmp_path) -> None:
    root = _copy(tmp_path)
    name = "layers.1.attn.compressor.norm.weight"
    edit_header(shard_of(root, name), lambda h: h[name].__setitem__("shape", [32, 2]))
    with pytest.raises(CheckpointError, match="compressor.norm.weight"):
        DeepseekV41Model.from_checkpoint(root, quant="none")


def test_engram_needs_the_tokenizer(tmp_path) -> None:
    root = _copy(tmp_path)
    (root / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        DeepseekV41Model.from_checkpoint(root, quant="none")


@pytest.mark.parametrize("text", ["{not json", '{"model": 3}'])
def test_corrupt_tokenizer_names_the_file_before_any_weight_is_read(text: str, tmp_path) -> None:
    """A corrupt tokenizer.json was a bare `Exception` naming no file, raised after every block
    had loaded; it is now read right after the name checks (a missing shard is not reached)."""
    root = _copy(tmp_path)
    (root / "tokenizer.json").write_text(text)
    shard_of(root, "norm.weight").unlink()  # the first weight read would fail on it
    lines: list[str] = []
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(_fresh(), root, progress=lines.append)
    msg = str(e.value)
    assert msg.startswith(f"{root / 'tokenizer.json'}: cannot load the tokenizer (")
    assert "\n" not in msg
    assert not [line for line in lines if "loaded block" in line]


def test_engram_model_without_tables_says_so() -> None:
    from dsv4cp.runner import PrefillRunner

    model = DeepseekV41Model(DeepseekV41Config.from_hf(fx.CHECKPOINT), seed=0)
    with pytest.raises(ValueError, match="Engram layers but no hasher"):
        PrefillRunner(model, num_slots=64, max_context=32).prefill({"a": [3, 4, 5]})


@pytest.mark.parametrize(
    "shape,scale", [([330, 64], [330, 2]), ([320, 32], [320, 1])], ids=["reshaped", "fewer rows"]
)
def test_engram_table_of_other_dims_names_the_tensor_before_any_weight(
    shape: list[int], scale: list[int], tmp_path
) -> None:
    """An Engram table whose dims are not the config's (same bytes reshaped, or fewer rows):
    a CheckpointError naming the shard and tensor, before any block loads (it was a plain
    ValueError from `Engram.attach_table`, naming neither, after every block: a traceback
    under `dsv4cp check --checkpoint`)."""
    root = _copy(tmp_path)
    name, sname = "layers.0.engram.embed.weight", "layers.0.engram.embed.scale"
    shard = shard_of(root, name)

    def edit(h: dict) -> None:
        for key, dims in ((name, shape), (sname, scale)):
            begin = h[key]["data_offsets"][0]
            h[key].update(shape=dims, data_offsets=[begin, begin + dims[0] * dims[1]])

    edit_header(shard, edit)
    lines: list[str] = []
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(_fresh(), root, progress=lines.append)
    assert str(e.value) == (
        f"{shard}: Engram table '{name}' has shape {shape}, layer 0 of the config needs "
        "[660, 32] (engram_num_embeddings, engram_head_dim)"
    )
    assert not [line for line in lines if "loaded block" in line]
