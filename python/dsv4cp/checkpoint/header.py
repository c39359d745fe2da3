"""Parse and check a safetensors file's header without reading its tensor data.

Layout: 8-byte little-endian header length n, n bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the data
section; offsets are relative to the data section's start (8 + n).
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dsv4cp.checkpoint.errors import CheckpointError
from dsv4cp.config_fields import is_int

# safetensors dtype -> (torch dtype, numpy dtype of the raw storage for memmap)
DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "F64": (torch.float64, np.dtype("<f8")),
    "F32": (torch.float32, np.dtype("<f4")),
    "F16": (torch.float16, np.dtype("<f2")),
    "BF16": (torch.bfloat16, np.dtype("<u2")),  # raw bits
    "F8_E4M3": (torch.float8_e4m3fn, np.dtype("u1")),  # raw bits
    "F8_E5M2": (torch.float8_e5m2, np.dtype("u1")),  # raw bits
    "F8_E8M0": (torch.float8_e8m0fnu, np.dtype("u1")),  # raw bits
    "I64": (torch.int64, np.dtype("<i8")),
    "I32": (torch.int32, np.dtype("<i4")),
    "I16": (torch.int16, np.dtype("<i2")),
    "I8": (torch.int8, np.dtype("i1")),
    "U8": (torch.uint8, np.dtype("u1")),
    "BOOL": (torch.bool, np.dtype("?")),
}
_MAX_HEADER = 100 * 2**20  # the safetensors format's own limit


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a shard: its safetensors dtype, shape and absolute byte range in the file."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def torch_dtype(dtype: str) -> torch.dtype:
    return DTYPES[dtype][0]


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (ValueError if it has none)."""
    for name, (td, _) in DTYPES.items():
        if td == dtype:
            return name
    raise ValueError(f"no safetensors dtype for {dtype}")


def read_header(path: Path) -> dict[str, HeaderEntry]:
    """Every tensor's entry, checked against the file: known dtype, byte length = numel · itemsize,
    and data inside the file (a truncated shard is an error here, before any data is read)."""
    try:
        info = os.stat(path)
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError
        if not stat.S_ISREG(info.st_mode):  # a FIFO or device: open() or read() would block
            raise CheckpointError(f"{path}: not a regular file, cannot be a shard")
        size = info.st_size
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", raw_len)
            if n > min(_MAX_HEADER, size - 8):
                raise CheckpointError(f"{path}: header length {n} exceeds the file ({size} bytes)")
            text = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: shard file is missing") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, not a shard file") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the shard ({e.strerror or e})") from None
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    data_start = 8 + n
    entries = {}
    for name, info in header.items():
        if name != "__metadata__":
            entries[name] = _entry(path, name, info, data_start, size)
    return entries


def _entry(path: Path, name: str, info: object, data_start: int, size: int) -> HeaderEntry:
    """One header entry, checked: `dtype` a known name, `shape` a list of non-negative integers,
    `data_offsets` two integers (JSON strings, floats and booleans are refused, not coerced)."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise CheckpointError(
            f"{where}: malformed header entry {info!r} (needs dtype, shape and data_offsets)"
        )
    dtype, raw_shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str):
        raise CheckpointError(f"{where}: dtype must be a string, got {dtype!r}")
    if dtype not in DTYPES:
        raise CheckpointError(f"{where}: unsupported dtype {dtype!r}")
    if not isinstance(raw_shape, list) or not all(is_int(d) and d >= 0 for d in raw_shape):
        raise CheckpointError(
            f"{where}: shape must be a list of non-negative integers, got {raw_shape!r}"
        )
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(is_int, offsets)):
        raise CheckpointError(f"{where}: data_offsets must be two integers, got {offsets!r}")
    shape: tuple[int, ...] = tuple(raw_shape)
    begin, end = offsets
    nbytes = math.prod(shape) * DTYPES[dtype][1].itemsize
    if begin < 0 or end - begin != nbytes:
        raise CheckpointError(
            f"{where}: {dtype} {list(shape)} needs {nbytes} bytes but "
            f"data_offsets give [{begin}, {end}]"
        )
    if data_start + end > size:
        raise CheckpointError(
            f"{path}: truncated: tensor {name!r} ends at byte {data_start + end}, "
            f"the file has {size} bytes"
        )
    return HeaderEntry(dtype, shape, data_start + begin, data_start + end)
