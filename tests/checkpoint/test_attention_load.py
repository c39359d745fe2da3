"""The attention's weights from the released format: every `layers.L.attn.*` tensor read through
`checkpoint_slots`, wo_a dequantized; and a bad checkpoint is a CheckpointError naming the
tensor and the file, with nothing of the layer written."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dsv4cp.checkpoint import CheckpointError, CheckpointReader, load_into
from dsv4cp.config import DeepseekV41Config
from dsv4cp.layers.attention import DeepseekV41Attention
from dsv4cp.ops.linear import dequant_fp8_blocks
from tests.checkpoint.corrupt import (
    FIXTURE,
    copy_checkpoint,
    edit_header,
    edit_index,
    shard_of,
    truncate,
)

LAYER = 1  # a ratio-2 kv source and index source: every attention tensor kind
PREFIX = f"layers.{LAYER}.attn."
SHARD = "model-00001-of-00003.safetensors"


def attention(layer: int = LAYER) -> DeepseekV41Attention:
    cfg = DeepseekV41Config.from_hf(FIXTURE)
    return DeepseekV41Attention(cfg, layer, dtype=torch.bfloat16, quant="qat")


def load(attn: DeepseekV41Attention, reader: CheckpointReader, prefix: str = PREFIX) -> None:
    slots = attn.checkpoint_slots(prefix)
    load_into(slots, reader, list(slots), dequantize=attn.checkpoint_dequantize(prefix))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().contiguous().view(torch.uint8)


def snapshot(attn: DeepseekV41Attention) -> dict[str, torch.Tensor]:
    return {k: bits(v) for k, v in attn.state_dict(keep_vars=True).items()}


@pytest.mark.parametrize("layer", range(7))
def test_every_attention_tensor_is_loaded_as_stored(layer: int) -> None:
    attn, prefix = attention(layer), f"layers.{layer}.attn."
    with CheckpointReader(FIXTURE) as r:
        names = {n for n in r.names() if n.startswith(prefix)}
        load(attn, r, prefix)
        slots = attn.checkpoint_slots(prefix)
        assert set(slots) | {prefix + "wo_a.scale"} == names  # every stored tensor, no other
        for name, tensor in slots.items():
            if name != prefix + "wo_a.weight":
                assert torch.equal(bits(tensor), bits(r.get(name))), name
        wo_a = dequant_fp8_blocks(r.get(prefix + "wo_a.weight"), r.get(prefix + "wo_a.scale"))
        assert torch.equal(attn.wo_a, wo_a.bfloat16())
    assert attn.wqkv_a.storage == "fp8" and attn.wo_a.dtype == torch.bfloat16
    assert attn.attn_sink.dtype == torch.float32 and attn.kv_norm.dtype == torch.bfloat16


def test_dense_model_has_no_scales_and_nothing_to_dequantize() -> None:
    attn = DeepseekV41Attention(DeepseekV41Config.tiny(), 1, dtype=torch.float32)
    slots = attn.checkpoint_slots(PREFIX)
    assert not [n for n in slots if n.endswith(".scale")]
    assert all(t.dtype == torch.float32 for t in slots.values())
    assert attn.checkpoint_dequantize(PREFIX) == frozenset()
    assert set(attn.checkpoint_weights()) == {n.removeprefix(PREFIX) for n in slots}


def test_fp8_storage_needs_a_q_lora_rank_of_whole_blocks() -> None:
    cfg = dataclasses.replace(DeepseekV41Config.from_hf(FIXTURE), q_lora_rank=48)
    with pytest.raises(ValueError, match="q_lora_rank 48 must be a multiple of 32"):
        DeepseekV41Attention(cfg, 1, dtype=torch.bfloat16)


def _header(name: str, **change: object) -> Callable[[Path], None]:
    return lambda root: edit_header(shard_of(root, name), lambda h: h[name].update(change))


def _drop_from_index(name: str) -> Callable[[Path], None]:
    return lambda root: edit_index(root, lambda m: m.pop(name))


def _rename_in_shard(name: str) -> Callable[[Path], None]:
    """The shard holds the bytes under another name; the index still points there."""

    def rename(header: dict) -> None:
        header[name + ".renamed"] = header.pop(name)

    return lambda root: edit_header(shard_of(root, name), rename)


def _truncate(root: Path) -> None:
    truncate(shard_of(root, PREFIX + "wq_b.weight"), 64)


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "tensor missing from the index": (
        _drop_from_index(PREFIX + "indexer.wq_b.weight"),
        r"'layers\.1\.attn\.indexer\.wq_b\.weight' is not in the checkpoint at .*checkpoint",
    ),
    "tensor missing from its shard": (
        _rename_in_shard(PREFIX + "compressor.wgate.weight"),
        rf"{SHARD}: the index maps tensor 'layers\.1\.attn\.compressor\.wgate\.weight' here",
    ),
    "scale missing": (
        _drop_from_index(PREFIX + "wkv.scale"),
        rf"{SHARD}: tensor 'layers\.1\.attn\.wkv\.weight' has no scale",
    ),
    "misshaped weight": (  # [64] -> [32, 2]: the same bytes
        _header(PREFIX + "compressor.norm.weight", shape=[32, 2]),
        rf"{SHARD}: tensor 'layers\.1\.attn\.compressor\.norm\.weight' has shape \[32, 2\], "
        r"the model holds \[64\]",
    ),
    "misshaped fp8 weight": (  # wq_b [256, 64] -> [128, 128]: its scale no longer fits
        _header(PREFIX + "wq_b.weight", shape=[128, 128]),
        rf"{SHARD}: scale 'layers\.1\.attn\.wq_b\.scale' has shape \[8, 2\], its weight "
        r"'layers\.1\.attn\.wq_b\.weight' \[128, 128\] \(fp8\) needs \[4, 4\]",
    ),
    "wrong dtype": (
        _header(PREFIX + "kv_norm.weight", dtype="F16"),
        rf"{SHARD}: tensor 'layers\.1\.attn\.kv_norm\.weight' is F16, a bf16 tensor must be BF16",
    ),
    "wrong fp8 dtype": (
        _header(PREFIX + "wo_b.weight", dtype="F8_E5M2"),
        rf"{SHARD}: tensor 'layers\.1\.attn\.wo_b\.weight' is F8_E5M2, a fp8 tensor must be "
        "F8_E4M3",
    ),
    "scale not matching its weight": (  # [16, 2] -> [32, 1]: the same bytes
        _header(PREFIX + "indexer.wq_b.scale", shape=[32, 1]),
        rf"{SHARD}: scale 'layers\.1\.attn\.indexer\.wq_b\.scale' has shape \[32, 1\], its "
        r"weight 'layers\.1\.attn\.indexer\.wq_b\.weight' \[512, 64\] \(fp8\) needs \[16, 2\]",
    ),
    "scale in the wrong dtype": (
        _header(PREFIX + "wo_a.scale", dtype="U8"),
        rf"{SHARD}: tensor 'layers\.1\.attn\.wo_a\.scale' is U8, a scale tensor must be F8_E8M0",
    ),
    "truncated shard": (_truncate, rf"{SHARD}: truncated"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_checkpoint_is_a_clear_error_and_nothing_is_loaded(tmp_path: Path, case: str) -> None:
    corrupt, message = CASES[case]
    root = copy_checkpoint(tmp_path / "ckpt")
    corrupt(root)
    attn = attention()
    before = snapshot(attn)
    with CheckpointReader(root) as r, pytest.raises(CheckpointError, match=message):
        load(attn, r)
    after = snapshot(attn)
    assert all(torch.equal(after[k], v) for k, v in before.items()), "a tensor was written"
