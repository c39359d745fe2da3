"""Copies of the fixture checkpoint with one defect each (for the reader / loader tests)."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "dsv41-tiny-reference" / "checkpoint"
INDEX = "model.safetensors.index.json"


def copy_checkpoint(dst: Path) -> Path:
    """The fixture's index and shards copied under dst (the reference outputs are not needed)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in FIXTURE.glob("*.safetensors"):
        shutil.copy(f, dst / f.name)
    shutil.copy(FIXTURE / INDEX, dst / INDEX)
    return dst


def shard_of(root: Path, name: str) -> Path:
    return root / json.loads((root / INDEX).read_text())["weight_map"][name]


def edit_header(shard: Path, edit: Callable[[dict], None]) -> None:
    """Rewrite a shard's JSON header (data bytes unchanged; offsets are relative to the data)."""
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def edit_index(root: Path, edit: Callable[[dict], None]) -> None:
    index = json.loads((root / INDEX).read_text())
    edit(index["weight_map"])
    (root / INDEX).write_text(json.dumps(index))


def truncate(shard: Path, drop: int) -> None:
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - drop])


def overwrite_element(shard: Path, name: str, element: int, raw: bytes) -> None:
    """Write `raw` (one element's bytes, e.g. a NaN pattern) over element `element` (row-major)
    of tensor `name` in `shard`."""
    data = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    begin = 8 + n + json.loads(data[8 : 8 + n])[name]["data_offsets"][0]
    at = begin + element * len(raw)
    data[at : at + len(raw)] = raw
    shard.write_bytes(bytes(data))
