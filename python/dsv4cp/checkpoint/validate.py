"""Checks the loaders call before trusting a tensor: expected dtype per tensor kind, and a
quantized weight's `.scale` (present, F8_E8M0, the shape its weight implies)."""

from __future__ import annotations

from collections.abc import Iterable

from dsv4cp.checkpoint.errors import CheckpointError
from dsv4cp.checkpoint.formats import (
    KIND_DTYPE,
    QUANTIZED_KINDS,
    TensorKind,
    expected_scale_shape,
    scale_name,
    tensor_kind,
)
from dsv4cp.checkpoint.reader import CheckpointReader


def check_dtype(reader: CheckpointReader, name: str, kind: TensorKind | None = None) -> None:
    """`name` is stored in the dtype of its kind (given, or from its name; no rule -> no check)."""
    kind = kind or tensor_kind(name)
    spec = reader.spec(name)
    if kind is not None and spec.dtype != KIND_DTYPE[kind]:
        raise CheckpointError(
            f"{spec.file}: tensor {name!r} is {spec.dtype}, "
            f"a {kind} tensor must be {KIND_DTYPE[kind]}"
        )


def check_quantized_weight(
    reader: CheckpointReader, name: str, kind: TensorKind | None = None
) -> None:
    """A quantized `.weight` and its `.scale`: dtypes, and scale shape [ceil(out/32), ceil(in/32)]
    (fp8), [out, in/32] for packed fp4 [out, in/2], [rows, dim/32] for an Engram table."""
    kind = kind or tensor_kind(name)
    if kind not in QUANTIZED_KINDS:
        raise ValueError(f"check_quantized_weight: {name!r} is not a quantized weight ({kind})")
    check_dtype(reader, name, kind)
    spec, sname = reader.spec(name), scale_name(name)
    if not reader.has(sname):
        raise CheckpointError(
            f"{spec.file}: tensor {name!r} has no scale {sname!r} in the checkpoint"
        )
    check_dtype(reader, sname, "scale")
    try:
        expected = expected_scale_shape(kind, spec.shape)
    except ValueError as e:
        raise CheckpointError(f"{spec.file}: tensor {name!r}: {e}") from None
    scale = reader.spec(sname)
    if scale.shape != expected:
        raise CheckpointError(
            f"{scale.file}: scale {sname!r} has shape {list(scale.shape)}, its weight {name!r} "
            f"{list(spec.shape)} ({kind}) needs {list(expected)}"
        )


def validate_checkpoint(reader: CheckpointReader, names: Iterable[str] | None = None) -> None:
    """Check every named tensor (default: all): readable header, dtype of its kind, and for
    quantized weights the scale. Raises one CheckpointError listing every problem."""
    problems = []
    for name in reader.names() if names is None else names:
        kind = tensor_kind(name)
        try:
            if kind in QUANTIZED_KINDS:
                check_quantized_weight(reader, name, kind)
            else:
                check_dtype(reader, name, kind)
        except CheckpointError as e:
            problems.append(str(e))
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  … and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CheckpointError(f"{len(problems)} checkpoint problem(s):\n  {shown}{more}")
