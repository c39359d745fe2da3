"""Order guard: every CP rank must issue the same collectives, in the same order, with the same
(tag, shape, dtype) (docs/invariants.md, invariant 1).

Each collective gets a `CollectiveRecord` (sequence number, kind, tag, shape, dtype). Backends
compare the records of all ranks before the real collective: `TorchDistCPGroup` all-gathers a
fixed-size int64 encoding (`RECORD_LEN` words), `FakeCPGroup` compares them at its barrier. Every
rank sees the same records, so every rank raises the same `CPOrderError` instead of one rank
hanging in a collective the others never issue.

On in tests, with `--debug-cp`, or with the environment variable `DSV4CP_DEBUG_CP=1`.
"""

from __future__ import annotations

import logging
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dsv4cp import env_vars

__all__ = [
    "ENV_VAR",
    "RECORD_LEN",
    "CPOrderError",
    "CollectiveRecord",
    "OrderGuard",
    "debug_cp_enabled",
    "resolve_check_order",
    "split_tag",
    "splits_crc",
]

ENV_VAR = "DSV4CP_DEBUG_CP"
logger = logging.getLogger("dsv4cp.cp")

# int64 record layout
_MAGIC = 0x44535634  # "DSV4"
_MAX_DIMS = 8
_TAG_WORDS = 8  # 64 tag bytes travel verbatim (the crc covers the whole tag)
_OFF_MAGIC, _OFF_SEQ, _OFF_KIND, _OFF_TAG_CRC, _OFF_TAG_LEN = 0, 1, 2, 3, 4
_OFF_DTYPE, _OFF_NDIM, _OFF_SHAPE_CRC, _OFF_DIMS = 5, 6, 7, 8
_OFF_TAG = _OFF_DIMS + _MAX_DIMS
_OFF_SPLITS = _OFF_TAG + _TAG_WORDS  # all_to_all: crc of the split matrix (0 otherwise)
RECORD_LEN = _OFF_SPLITS + 1

_KINDS = ("all_gather", "barrier", "all_to_all")
_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
)


def debug_cp_enabled() -> bool:
    """True when `DSV4CP_DEBUG_CP` is set to 1/true/yes/on (0/false/no/off: not; anything else
    is an EnvVarError)."""
    return bool(env_vars.read(ENV_VAR))


def resolve_check_order(flag: bool | None) -> bool:
    """The order guard is on when asked for, or when `DSV4CP_DEBUG_CP=1` (either turns it on)."""
    return bool(flag) or debug_cp_enabled()


def split_tag(tag: str) -> tuple[str, str]:
    """ "layer3/kv_raw" → ("layer3", "kv_raw"); a tag without "/" has layer "?"."""
    layer, sep, tensor = tag.partition("/")
    return (layer, tensor) if sep else ("?", tag)


def _crc(text: str) -> int:
    return zlib.crc32(text.encode("utf-8"))


def splits_crc(splits: Sequence[Sequence[int]] | None) -> int:
    """A crc of an all_to_all split matrix (0 for None): ranks that pass different matrices
    disagree on it."""
    if splits is None:
        return 0
    return _crc(repr([[int(v) for v in row] for row in splits]))


def _dtype_code(dtype: torch.dtype | None) -> int:
    if dtype is None:
        return 0
    try:
        return _DTYPES.index(dtype) + 1
    except ValueError:
        return (1 << 32) | _crc(str(dtype))


def _dtype_name(code: int) -> str:
    if code == 0:
        return "-"
    if 1 <= code <= len(_DTYPES):
        return str(_DTYPES[code - 1]).removeprefix("torch.")
    return f"dtype#{code & 0xFFFFFFFF:08x}"


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as issued by one rank. `tag_crc` identifies the tag even when `tag` came
    back truncated from the fixed-size wire encoding."""

    seq: int
    kind: str
    tag: str
    shape: tuple[int, ...]
    dtype: str
    tag_crc: int
    dtype_code: int
    splits: int = 0  # all_to_all: `splits_crc` of the split matrix

    @classmethod
    def of(
        cls,
        seq: int,
        kind: str,
        tag: str,
        x: Tensor | None,
        *,
        shape: tuple[int, ...] | None = None,
        splits: int = 0,
    ) -> CollectiveRecord:
        """`shape` overrides x's (all_to_all records the rows of every rank, which all ranks
        agree on, instead of this rank's own)."""
        if shape is None:
            shape = tuple(int(s) for s in x.shape) if x is not None else ()
        code = _dtype_code(x.dtype if x is not None else None)
        return cls(seq, kind, tag, shape, _dtype_name(code), _crc(tag), code, splits)

    def encode(self) -> list[int]:
        out = [0] * RECORD_LEN
        raw = self.tag.encode("utf-8")
        out[_OFF_MAGIC], out[_OFF_SEQ] = _MAGIC, self.seq
        out[_OFF_KIND] = _KINDS.index(self.kind) + 1
        out[_OFF_TAG_CRC], out[_OFF_TAG_LEN] = self.tag_crc, len(raw)
        out[_OFF_DTYPE], out[_OFF_NDIM] = self.dtype_code, len(self.shape)
        out[_OFF_SHAPE_CRC] = _crc(repr(self.shape))
        for i in range(_MAX_DIMS):
            out[_OFF_DIMS + i] = self.shape[i] if i < len(self.shape) else -1
        chunk = raw[: 8 * _TAG_WORDS].ljust(8 * _TAG_WORDS, b"\0")
        for i in range(_TAG_WORDS):
            out[_OFF_TAG + i] = int.from_bytes(chunk[8 * i : 8 * i + 8], "little", signed=True)
        out[_OFF_SPLITS] = self.splits
        return out

    @classmethod
    def decode(cls, words: Sequence[int]) -> CollectiveRecord:
        w = [int(v) for v in words]
        if len(w) != RECORD_LEN or w[_OFF_MAGIC] != _MAGIC:
            raise ValueError(f"not an order-guard record: {w[:4]}...")
        raw = b"".join(
            w[_OFF_TAG + i].to_bytes(8, "little", signed=True) for i in range(_TAG_WORDS)
        )[: w[_OFF_TAG_LEN]]
        tag = raw.decode("utf-8", errors="replace")
        if w[_OFF_TAG_LEN] > 8 * _TAG_WORDS:
            tag += "…"
        ndim = w[_OFF_NDIM]
        shape = tuple(w[_OFF_DIMS : _OFF_DIMS + min(ndim, _MAX_DIMS)])
        if ndim > _MAX_DIMS:
            shape += (-1,) * (ndim - _MAX_DIMS)  # compared through the shape crc below
        kind = _KINDS[w[_OFF_KIND] - 1] if 1 <= w[_OFF_KIND] <= len(_KINDS) else "?"
        rec = cls(
            w[_OFF_SEQ],
            kind,
            tag,
            shape,
            _dtype_name(w[_OFF_DTYPE]),
            w[_OFF_TAG_CRC],
            w[_OFF_DTYPE],
            w[_OFF_SPLITS],
        )
        return rec

    def describe(self) -> str:
        if self.kind == "barrier":
            return "barrier"
        layer, tensor = split_tag(self.tag)
        splits = f" splits#{self.splits & 0xFFFFFFFF:08x}" if self.kind == "all_to_all" else ""
        return (
            f"{self.kind} {self.tag!r} (layer {layer!r}, tensor {tensor!r}) "
            f"shape {self.shape} {self.dtype}{splits}"
        )

    def _shape_key(self) -> tuple:
        return (self.kind, self.shape, self.dtype_code, self.splits)

    def _order_key(self) -> tuple:
        return (self.seq, self.kind, self.tag_crc, self.shape, self.dtype_code, self.splits)


class CPOrderError(RuntimeError):
    """Ranks disagree on a collective. Raised on every rank with the same records."""

    def __init__(
        self, message: str, *, seq: int, records: Sequence[CollectiveRecord], fields: Sequence[str]
    ) -> None:
        super().__init__(message)
        self.seq = seq
        self.records = tuple(records)
        self.tags = tuple(r.tag for r in records)
        self.fields = tuple(fields)

    def __reduce__(self) -> tuple:  # picklable, so spawned ranks can send it back
        return (_rebuild_order_error, (str(self), self.seq, self.records, self.fields))


def _rebuild_order_error(message: str, seq: int, records: tuple, fields: tuple) -> CPOrderError:
    return CPOrderError(message, seq=seq, records=records, fields=fields)


def _diff_fields(a: CollectiveRecord, b: CollectiveRecord) -> list[str]:
    out = []
    for name, x, y in (
        ("sequence number", a.seq, b.seq),
        ("kind", a.kind, b.kind),
        ("tag", a.tag_crc, b.tag_crc),
        ("shape", a.shape, b.shape),
        ("dtype", a.dtype_code, b.dtype_code),
        ("splits", a.splits, b.splits),
    ):
        if x != y:
            out.append(name)
    return out


class OrderGuard:
    """Per-rank sequence counter plus the cross-rank check. Keeps a short local history for
    error messages; logs every collective at DEBUG level on the "dsv4cp.cp" logger."""

    def __init__(self, rank: int, cp_size: int, *, history: int = 4) -> None:
        self.rank = rank
        self.cp_size = cp_size
        self.seq = 0
        self._history: deque[CollectiveRecord] = deque(maxlen=history)

    def reset(self) -> None:
        self.seq = 0
        self._history.clear()

    def next(
        self,
        kind: str,
        tag: str,
        x: Tensor | None,
        *,
        shape: tuple[int, ...] | None = None,
        splits: int = 0,
    ) -> CollectiveRecord:
        rec = CollectiveRecord.of(self.seq, kind, tag, x, shape=shape, splits=splits)
        self.seq += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("[cp rank %d/%d] #%d %s", self.rank, self.cp_size, rec.seq, rec.describe())
        self._history.append(rec)
        return rec

    def verify(self, records: Sequence[CollectiveRecord], *, check_tags: bool = True) -> None:
        """Raise `CPOrderError` unless every rank's record matches. With check_tags False only
        (kind, shape, dtype) must match (the minimum for a well-formed all-gather)."""
        key = CollectiveRecord._order_key if check_tags else CollectiveRecord._shape_key
        ref = key(records[0])
        if all(key(r) == ref for r in records[1:]):
            return
        fields: list[str] = []
        for r in records[1:]:
            for f in _diff_fields(records[0], r):
                if f not in fields and (check_tags or f in ("kind", "shape", "dtype", "splits")):
                    fields.append(f)
        mine = records[self.rank] if self.rank < len(records) else records[0]
        lines = [
            f"CP collective mismatch at collective #{mine.seq} (detected on rank {self.rank} "
            f"of {self.cp_size}): ranks disagree on {', '.join(fields)}"
        ]
        for i, r in enumerate(records):
            same = next((j for j in range(i) if key(records[j]) == key(r)), None)
            desc = f"same as rank {same}" if same is not None else f"#{r.seq} {r.describe()}"
            lines.append(f"  rank {i}: {desc}")
        prev = [h for h in self._history if h.seq < mine.seq]
        if prev:
            lines.append(
                f"  previous collective on rank {self.rank}: #{prev[-1].seq} {prev[-1].describe()}"
            )
        if "splits" in fields and "tag" not in fields:
            lines.append(
                "Every rank must pass the same all_to_all split matrix (from an all_gather of "
                "the send counts: cp.group.split_matrix)."
            )
        elif "shape" in fields and "tag" not in fields:
            lines.append(
                "Every rank must pass the same physical rows P (pad with "
                "CPLayout.shard) and the same trailing dims."
            )
        else:
            lines.append(
                "Every rank must issue the same collectives in the same order from "
                "one stream, with no rank-dependent skips (docs/invariants.md, "
                "invariant 1)."
            )
        raise CPOrderError("\n".join(lines), seq=mine.seq, records=records, fields=fields)
