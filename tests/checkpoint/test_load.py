"""load_into: everything read and checked before anything is written."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from dsv4cp.checkpoint import CheckpointError, CheckpointReader, load_into
from dsv4cp.layers.linear import Linear
from dsv4cp.ops.linear import dequant_fp8_blocks
from tests.checkpoint.corrupt import (
    FIXTURE,
    copy_checkpoint,
    edit_header,
    edit_index,
    overwrite_element,
    shard_of,
    truncate,
)

# params key -> checkpoint name; head.weight (shard 2) first, so a later failure in shard 1 must
# leave an already-read tensor unwritten
NAMES = {
    "head": "head.weight",
    "wq_a.weight": "layers.0.attn.wq_a.weight",
    "wq_a.scale": "layers.0.attn.wq_a.scale",
    "expert.weight": "layers.0.ffn.experts.1.w1.weight",
    "expert.scale": "layers.0.ffn.experts.1.w1.scale",
    "kv_norm": "layers.0.attn.kv_norm.weight",
    "attn_sink": "layers.0.attn.attn_sink",
    "wo_a": "layers.0.attn.wo_a.weight",
}
WO_A = NAMES["wo_a"]


def make_params() -> dict[str, torch.Tensor]:
    m = nn.Module()
    m.wq_a = Linear(128, 64, storage="fp8", dtype=torch.bfloat16, device="cpu")
    m.expert = Linear(128, 64, storage="fp4", dtype=torch.bfloat16, device="cpu")
    params = dict(m.state_dict(keep_vars=True))
    params["head"] = torch.zeros(256, 128, dtype=torch.bfloat16)
    params["kv_norm"] = torch.zeros(64, dtype=torch.bfloat16)
    params["attn_sink"] = torch.zeros(4)
    params["wo_a"] = torch.zeros(64, 128, dtype=torch.bfloat16)
    return params


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().view(torch.uint8)


def test_load_into_copies_checked_tensors() -> None:
    params = make_params()
    with CheckpointReader(FIXTURE) as r:
        load_into(params, r, NAMES, dequantize={WO_A})
        for key, name in NAMES.items():
            if name != WO_A:
                assert torch.equal(bits(params[key]), bits(r.get(name)))
        wo_a = dequant_fp8_blocks(r.get(WO_A), r.get("layers.0.attn.wo_a.scale"))
        assert torch.equal(params["wo_a"], wo_a.bfloat16())


def test_load_into_rejects_model_mismatches() -> None:
    with CheckpointReader(FIXTURE) as r:
        params = make_params()
        params["kv_norm"] = torch.zeros(64)  # fp32 in the model, BF16 stored
        with pytest.raises(CheckpointError, match=r"kv_norm\.weight' is BF16, the model holds F32"):
            load_into(params, r, NAMES, dequantize={WO_A})
        params = make_params()
        params["attn_sink"] = torch.zeros(8)
        with pytest.raises(
            CheckpointError, match=r"attn_sink' has shape \[4\], the model holds \[8\]"
        ):
            load_into(params, r, NAMES, dequantize={WO_A})
        with pytest.raises(ValueError, match="with no checkpoint name: \\['wo_a'\\]"):
            load_into(make_params(), r, {k: v for k, v in NAMES.items() if k != "wo_a"})
        with pytest.raises(ValueError, match="no such parameters: \\['bogus'\\]"):
            load_into(make_params(), r, {**NAMES, "bogus": "norm.weight"}, dequantize={WO_A})


def _drop_tensor(root: Path) -> None:
    edit_index(root, lambda m: m.pop("layers.0.attn.attn_sink"))


def _drop_scale(root: Path) -> None:
    edit_index(root, lambda m: m.pop("layers.0.attn.wq_a.scale"))


def _truncate_shard(root: Path) -> None:
    truncate(shard_of(root, WO_A), 100)


def _wrong_dtype(root: Path) -> None:
    edit_header(
        shard_of(root, WO_A), lambda h: h["layers.0.attn.kv_norm.weight"].update(dtype="F16")
    )


def _misshaped_scale(root: Path) -> None:
    name = "layers.0.ffn.experts.1.w1.scale"  # [64, 4] -> [128, 2]: same bytes
    edit_header(shard_of(root, WO_A), lambda h: h[name].update(shape=[128, 2]))


def _missing_shard(root: Path) -> None:
    shard_of(root, WO_A).unlink()


def _poke(name: str, element: int, raw: bytes) -> Callable[[Path], None]:
    return lambda root: overwrite_element(shard_of(root, name), name, element, raw)


BF16_NAN, BF16_NEG_INF, F32_INF = b"\xc0\x7f", b"\x80\xff", struct.pack("<f", float("inf"))
E4M3_NAN, E8M0_NAN = b"\x7f", b"\xff"
CORRUPTIONS: dict[str, tuple[Callable[[Path], None], str]] = {
    "NaN in a bf16 tensor": (
        _poke("head.weight", 130, BF16_NAN),
        r"model-00002-of-00003\.safetensors: tensor 'head\.weight' holds a non-finite value nan "
        r"at index \[1, 2\] \(1 of 32768 elements",
    ),
    "-inf in a bf16 norm": (
        _poke("layers.0.attn.kv_norm.weight", 5, BF16_NEG_INF),
        r"'layers\.0\.attn\.kv_norm\.weight' holds a non-finite value -inf at index \[5\]",
    ),
    "inf in an fp32 sink": (
        _poke("layers.0.attn.attn_sink", 3, F32_INF),
        r"'layers\.0\.attn\.attn_sink' holds a non-finite value inf at index \[3\]",
    ),
    "NaN code in a kept fp8 weight": (
        _poke("layers.0.attn.wq_a.weight", 0, E4M3_NAN),
        r"'layers\.0\.attn\.wq_a\.weight' holds a non-finite value nan at index \[0, 0\]",
    ),
    "NaN scale of a kept fp8 weight": (
        _poke("layers.0.attn.wq_a.scale", 1, E8M0_NAN),
        r"'layers\.0\.attn\.wq_a\.scale' holds a non-finite value nan at index \[0, 1\]",
    ),
    "NaN scale of a dequantized weight": (
        _poke("layers.0.attn.wo_a.scale", 0, E8M0_NAN),
        r"'layers\.0\.attn\.wo_a\.weight' holds a non-finite value nan at index \[0, 0\]",
    ),
    "missing tensor": (_drop_tensor, r"'layers\.0\.attn\.attn_sink' is not in the checkpoint"),
    "missing scale": (_drop_scale, r"wq_a\.weight' has no scale 'layers\.0\.attn\.wq_a\.scale'"),
    "truncated shard": (_truncate_shard, r"model-00001-of-00003\.safetensors: truncated"),
    "wrong dtype": (_wrong_dtype, r"kv_norm\.weight' is F16, a bf16 tensor must be BF16"),
    "misshaped scale": (_misshaped_scale, r"w1\.scale' has shape \[128, 2\].* needs \[64, 4\]"),
    "missing shard": (_missing_shard, r"model-00001-of-00003\.safetensors: shard file is missing"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_nothing_is_written_when_any_tensor_is_bad(tmp_path: Path, case: str) -> None:
    corrupt, message = CORRUPTIONS[case]
    root = copy_checkpoint(tmp_path / "ckpt")
    corrupt(root)
    params = make_params()
    before = {k: bits(v) for k, v in params.items()}
    with CheckpointReader(root) as r, pytest.raises(CheckpointError, match=message):
        load_into(params, r, NAMES, dequantize={WO_A})
    for key, value in params.items():
        assert torch.equal(bits(value), before[key]), key


def test_check_finite_can_be_turned_off(tmp_path: Path) -> None:
    root = copy_checkpoint(tmp_path / "ckpt")
    _poke("head.weight", 130, BF16_NAN)(root)
    params = make_params()
    with CheckpointReader(root) as r:
        load_into(params, r, NAMES, dequantize={WO_A}, check_finite=False)
    assert torch.isnan(params["head"][1, 2]) and int(torch.isnan(params["head"]).sum()) == 1
