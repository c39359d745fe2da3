"""Access to the tiny released-format checkpoint and DeepSeek's reference outputs (test data).

Tensors are read by checkpoint name straight from the shards (safetensors), so the tests share
no loading code with the modules they check.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "dsv41-tiny-reference"
CHECKPOINT = FIXTURE / "checkpoint"
TOKENIZER = CHECKPOINT / "tokenizer.json"


@functools.lru_cache(maxsize=1)
def reference() -> dict[str, Tensor]:
    return load_file(str(FIXTURE / "reference_outputs.safetensors"))


@functools.lru_cache(maxsize=1)
def _weight_map() -> dict[str, str]:
    index = json.loads((CHECKPOINT / "model.safetensors.index.json").read_text())
    return index["weight_map"]


def names() -> list[str]:
    return sorted(_weight_map())


def tensor(name: str) -> Tensor:
    with safe_open(str(CHECKPOINT / _weight_map()[name]), "pt") as f:
        return f.get_tensor(name)


def text_config() -> SimpleNamespace:
    """The checkpoint's ``text_config`` as an attribute namespace (HF field names)."""
    cfg = json.loads((CHECKPOINT / "config.json").read_text())["text_config"]
    return SimpleNamespace(**cfg)


def load_slots(slots: dict[str, Tensor]) -> None:
    """Copy each checkpoint tensor into its slot; dtype and shape must match exactly."""
    for name, dst in slots.items():
        src = tensor(name)
        if src.dtype != dst.dtype or src.shape != dst.shape:
            raise AssertionError(
                f"{name}: checkpoint {src.dtype} {tuple(src.shape)} vs slot {dst.dtype} "
                f"{tuple(dst.shape)}"
            )
        with torch.no_grad():
            dst.copy_(src)


def shard_memmap(name: str) -> np.memmap:
    """A read-only uint8/float row view of one tensor inside its shard (no whole-file read)."""
    path = CHECKPOINT / _weight_map()[name]
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    entry = header[name]
    start, end = entry["data_offsets"]
    dtype = {"F8_E4M3": np.uint8, "F8_E8M0": np.uint8, "F32": np.float32}[entry["dtype"]]
    count = (end - start) // np.dtype(dtype).itemsize
    view = np.memmap(path, dtype=dtype, mode="r", offset=8 + header_len + start, shape=(count,))
    return view.reshape(entry["shape"])


def ulp_bf16(x: Tensor) -> Tensor:
    """One bf16 unit in the last place of |x| (2^(exponent - 7); the smallest normal's below)."""
    _, exp = torch.frexp(x.float().abs().clamp_min(2.0**-126))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exp - 8)
