"""Access to the tiny released-format checkpoint and DeepSeek's reference outputs (test data).

Checkpoint tensors come through `dsv4cp.checkpoint` (the reader, `load_into`, `memmap`), which
validates dtypes, shapes and scale layouts against the release's storage rules.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from safetensors.torch import load_file
from torch import Tensor

from dsv4cp.checkpoint import CheckpointReader, load_into

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "dsv41-tiny-reference"
CHECKPOINT = FIXTURE / "checkpoint"
TOKENIZER = CHECKPOINT / "tokenizer.json"


@functools.lru_cache(maxsize=1)
def reference() -> dict[str, Tensor]:
    return load_file(str(FIXTURE / "reference_outputs.safetensors"))


@functools.lru_cache(maxsize=1)
def reader() -> CheckpointReader:
    return CheckpointReader(CHECKPOINT)


def names() -> list[str]:
    return reader().names()


def tensor(name: str) -> Tensor:
    return reader().get(name)


def text_config() -> SimpleNamespace:
    """The checkpoint's ``text_config`` as an attribute namespace (HF field names)."""
    cfg = json.loads((CHECKPOINT / "config.json").read_text())["text_config"]
    return SimpleNamespace(**cfg)


def load_slots(slots: dict[str, Tensor]) -> None:
    """Copy each checkpoint tensor into its slot (checked: dtype, shape, scale layout)."""
    load_into(slots, reader(), list(slots))


def shard_memmap(name: str) -> np.memmap:
    """A read-only row view of one tensor inside its shard (fp8 / e8m0 as uint8 bytes)."""
    return reader().memmap(name)


def ulp_bf16(x: Tensor) -> Tensor:
    """One bf16 unit in the last place of |x| (2^(exponent - 7); the smallest normal's below)."""
    _, exp = torch.frexp(x.float().abs().clamp_min(2.0**-126))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exp - 8)
