"""`CheckpointReader`: lazy access to a released-format checkpoint's tensors, one shard at a time.

A checkpoint is a directory with `model.safetensors.index.json` (HF sharded layout: `weight_map`
name -> shard file) or a single `model.safetensors`; the path may also name either file. Shard
headers are parsed on first use (no tensor data read) and checked: a missing shard, a name the
index lists but its shard lacks, a header whose byte ranges do not fit the dtype or the file
(truncation) are `CheckpointError`s naming the tensor and the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np
import torch
from safetensors import safe_open
from torch import Tensor

from dsv4cp.checkpoint.errors import CheckpointError
from dsv4cp.checkpoint.header import DTYPES, HeaderEntry, read_header, safetensors_dtype

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class TensorSpec:
    """A tensor as its shard's header describes it: safetensors dtype (e.g. "F8_E4M3"), shape,
    and the shard's path."""

    dtype: str
    shape: tuple[int, ...]
    file: str


class CheckpointReader:
    """Read tensors of one checkpoint by name; at most one shard is open at any time."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        if path.is_dir():
            index, single = path / INDEX_FILE, path / SINGLE_FILE
            path = index if index.exists() else single
            if not path.exists():
                raise CheckpointError(f"{path.parent}: neither {INDEX_FILE} nor {SINGLE_FILE}")
        if not path.exists():
            raise CheckpointError(f"{path}: no such checkpoint file")
        self.root = path.parent
        if path.name.endswith(".json"):
            self._shard_of = _read_index(path)
        else:
            self._shard_of = dict.fromkeys(read_header(path), path.name)
        self._headers: dict[str, dict[str, HeaderEntry]] = {}
        self._open: tuple[str, object] | None = None

    # ---- names and specs (headers only) -------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(self._shard_of)

    def has(self, name: str) -> bool:
        return name in self._shard_of

    def file_of(self, name: str) -> str:
        """The path of the shard that holds `name` (per the index)."""
        if name not in self._shard_of:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint at {self.root}")
        return str(self.root / self._shard_of[name])

    def _entry(self, name: str) -> HeaderEntry:
        file = self.file_of(name)
        if file not in self._headers:
            try:
                self._headers[file] = read_header(Path(file))
            except CheckpointError as e:
                raise CheckpointError(f"cannot read tensor {name!r}: {e}") from None
        entry = self._headers[file].get(name)
        if entry is None:
            raise CheckpointError(
                f"{file}: the index maps tensor {name!r} here but the shard lacks it"
            )
        return entry

    def spec(self, name: str) -> TensorSpec:
        entry = self._entry(name)
        return TensorSpec(entry.dtype, entry.shape, self.file_of(name))

    # ---- data ---------------------------------------------------------------------------------

    def get(
        self,
        name: str,
        *,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str = "cpu",
    ) -> Tensor:
        """The tensor as stored. `dtype` (torch dtype or safetensors name), when given, is the
        dtype the caller expects: a different stored dtype is a CheckpointError (no conversion)."""
        spec = self.spec(name)
        if dtype is not None:
            want = dtype if isinstance(dtype, str) else safetensors_dtype(dtype)
            if spec.dtype != want:
                raise CheckpointError(
                    f"{spec.file}: tensor {name!r} is {spec.dtype}, expected {want}"
                )
        try:
            tensor = self._handle(spec.file).get_tensor(name)  # type: ignore[attr-defined]
        except Exception as e:  # the library's own error types
            raise CheckpointError(f"{spec.file}: cannot read tensor {name!r}: {e}") from None
        if tuple(tensor.shape) != spec.shape or tensor.dtype != DTYPES[spec.dtype][0]:
            raise CheckpointError(
                f"{spec.file}: tensor {name!r} read back as {tensor.dtype} "
                f"{list(tensor.shape)}, header says {spec.dtype} {list(spec.shape)}"
            )
        return tensor.to(device)

    def memmap(self, name: str) -> np.memmap:
        """A read-only numpy memmap of one tensor's bytes in its shard (no data read until indexed).

        The numpy dtype is the raw storage: float / int types as themselves, BF16 as uint16 bits,
        fp8 (E4M3, E5M2, E8M0) as uint8 bits; `torch.from_numpy(...).view(torch_dtype)` restores
        the torch dtype (see `read_rows`).
        """
        entry, file = self._entry(name), self.file_of(name)
        np_dtype = DTYPES[entry.dtype][1]
        return np.memmap(file, dtype=np_dtype, mode="r", offset=entry.start, shape=entry.shape)

    def read_rows(self, name: str, rows: Tensor) -> Tensor:
        """Rows `rows` (int tensor) of a tensor, read through its memmap, in the torch dtype."""
        entry = self._entry(name)
        picked = np.ascontiguousarray(self.memmap(name)[rows.cpu().numpy()])
        return torch.from_numpy(picked).view(DTYPES[entry.dtype][0])

    # ---- the one open shard -------------------------------------------------------------------

    def _handle(self, file: str) -> object:
        if self._open is not None and self._open[0] == file:
            return self._open[1]
        self.close()
        handle = safe_open(file, framework="pt")
        handle.__enter__()
        self._open = (file, handle)
        return handle

    def close(self) -> None:
        """Close the open shard, if any (the reader stays usable)."""
        if self._open is not None:
            _, handle = self._open
            self._open = None
            handle.__exit__(None, None, None)  # type: ignore[attr-defined]

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _read_index(path: Path) -> dict[str, str]:
    if not path.is_file():  # a FIFO would block read_text()
        raise CheckpointError(f"{path}: not a regular file, cannot be a safetensors index")
    try:
        index = json.loads(path.read_text())
        weight_map = index["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError, KeyError) as e:
        raise CheckpointError(
            f"{path}: not a safetensors index with a weight_map ({e!r})"
        ) from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{path}: weight_map must map tensor names to shard file names")
    for k, v in weight_map.items():
        if not (isinstance(v, str) and "/" not in v and v not in ("", ".", "..")):
            raise CheckpointError(
                f"{path}: weight_map maps tensor {k!r} to {v!r}, not a shard file name"
            )
    return weight_map
