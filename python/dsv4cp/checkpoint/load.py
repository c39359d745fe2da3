"""`load_into`: read and check every tensor first, copy into the module's tensors only after."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

import torch
from torch import Tensor

from dsv4cp.checkpoint.errors import CheckpointError
from dsv4cp.checkpoint.formats import QUANTIZED_KINDS, scale_name, tensor_kind
from dsv4cp.checkpoint.header import safetensors_dtype
from dsv4cp.checkpoint.reader import CheckpointReader
from dsv4cp.checkpoint.validate import check_dtype, check_quantized_weight
from dsv4cp.ops.finite import first_non_finite
from dsv4cp.ops.linear import dequant_fp8_blocks


def load_into(
    params: Mapping[str, Tensor],
    reader: CheckpointReader,
    names: Mapping[str, str] | Iterable[str],
    *,
    dequantize: Collection[str] = (),
    strict: bool = True,
    check_finite: bool = True,
) -> None:
    """Copy checkpoint tensors into `params` (e.g. dict(module.state_dict(keep_vars=True))).

    `names` maps a params key to its checkpoint name (an iterable: the same names). Each tensor
    must have the param's shape and dtype exactly, and pass the dtype / scale checks of its kind.
    Checkpoint names in `dequantize` (fp8 weights, e.g. `wo_a`) are dequantized with their
    `.scale` and rounded to the param's dtype, as DeepSeek's converter does. With `strict`, every
    key of `params` must be loaded. With `check_finite` (default), a floating-point tensor
    holding NaN or inf (after dequantization, for those in `dequantize`) is a CheckpointError
    naming the tensor, the file and the first bad element. Everything is read into new tensors
    first; the params are only written once all of them passed, so on any CheckpointError none
    was changed.
    Staging holds a copy of everything loaded: call it per layer for a large model.
    """
    mapping = dict(names) if isinstance(names, Mapping) else {n: n for n in names}
    unknown = sorted(set(mapping) - set(params))
    if unknown:
        raise ValueError(f"load_into: no such parameters: {unknown[:10]}")
    missing = sorted(set(params) - set(mapping))
    if strict and missing:
        raise ValueError(f"load_into: parameters with no checkpoint name: {missing[:10]}")
    staged = {
        key: _read(reader, name, params[key], name in dequantize, check_finite)
        for key, name in mapping.items()
    }
    with torch.no_grad():
        for key, value in staged.items():
            params[key].copy_(value)


def _read(
    reader: CheckpointReader, name: str, param: Tensor, dequant: bool, check_finite: bool
) -> Tensor:
    spec = reader.spec(name)
    if dequant:
        check_quantized_weight(reader, name, "fp8")
        value = dequant_fp8_blocks(reader.get(name), reader.get(scale_name(name))).to(param.dtype)
    else:
        kind = tensor_kind(name)
        if kind in QUANTIZED_KINDS:
            check_quantized_weight(reader, name, kind)
        else:
            check_dtype(reader, name, kind)
        want = safetensors_dtype(param.dtype)
        if spec.dtype != want:
            raise CheckpointError(
                f"{spec.file}: tensor {name!r} is {spec.dtype}, the model holds {want}"
            )
        value = reader.get(name)
    if tuple(value.shape) != tuple(param.shape):
        raise CheckpointError(
            f"{spec.file}: tensor {name!r} has shape {list(value.shape)}, the model holds "
            f"{list(param.shape)}"
        )
    bad = first_non_finite(value) if check_finite else None
    if bad is not None:
        index, v, count = bad
        raise CheckpointError(
            f"{spec.file}: tensor {name!r} holds a non-finite value {v} at index {list(index)} "
            f"({count} of {value.numel()} elements are NaN or inf)"
        )
    return value
