"""The reference file `dsv4cp reference-check` reads: a safetensors file with the keys of the
tiny fixture (`tests/fixtures/dsv41-tiny-reference/README.md`), each key the check reads checked
for dtype, shape and finiteness before use (`load_reference`), its fit to the model
(`check_model_fits`), and the `summary.json` beside it (`reference_sensitivity`)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from dsv4cp.model import DeepseekV41Model

REQUIRED = ("input_ids", "full_logits")


def read_reference_tensors(
    path: str | os.PathLike[str], required: tuple[str, ...]
) -> dict[str, Tensor]:
    """A reference outputs file's tensors, with `required` keys present: one ValueError naming
    the file when it is not there, not safetensors, or lacks a key. The reading both
    `reference-check` and `accuracy --reference` start from; each then checks the keys it
    reads."""
    from safetensors.torch import load_file

    file = Path(path)
    if not file.is_file():
        raise ValueError(f"no reference outputs file at {file}")
    try:
        ref = load_file(str(file))
    except Exception as e:  # safetensors' own error types
        raise ValueError(f"{file}: not a safetensors file ({e})") from None
    missing = [k for k in required if k not in ref]
    if missing:
        raise ValueError(f"{file}: lacks {missing} (see the fixture README)")
    return ref


def load_reference(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """The reference outputs, checked: the required keys, and every key the check reads (see the
    module docstring) of an integer or floating dtype as it must be, of the shape its
    `input_ids` implies, floats finite; an optional `summary.json` beside it is read too."""
    file = Path(path)
    try:
        ref = read_reference_tensors(file, REQUIRED)
    except ValueError as e:
        raise ValueError(f"reference-check: {e}") from None
    ids, logits = ref["input_ids"], ref["full_logits"]
    if ids.dim() != 2 or ids.shape[0] != 1 or not _integer(ids) or ids.numel() == 0:
        raise ValueError(
            f"reference-check: input_ids must be integer [1, T], got {ids.dtype} {tuple(ids.shape)}"
        )
    if logits.dim() != 3 or logits.shape[:2] != ids.shape or not logits.is_floating_point():
        raise ValueError(
            f"reference-check: full_logits {logits.dtype} {tuple(logits.shape)} is not floating "
            f"[1, T, V] for input_ids {tuple(ids.shape)}"
        )
    _check_layout(ref, file)
    reference_sensitivity(file)  # a summary.json beside it that cannot be read: said now
    return ref


_BLOCK_KEY = re.compile(r"^block(\d+)\.(out|pre_mix_in|topk)$")


def _integer(t: Tensor) -> bool:
    return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def _check_layout(ref: dict[str, Tensor], file: Path) -> None:
    """The optional keys' dtypes and leading dims (the model-dependent sizes are checked by
    `check_model_fits`), and every floating tensor the check reads finite."""
    t = ref["input_ids"].shape[1]

    def refuse(key: str, want: str) -> ValueError:
        v = ref[key]
        return ValueError(
            f"reference-check: {file}: {key} must be {want}, got {v.dtype} {tuple(v.shape)}"
        )

    read = ["full_logits"]
    for key, v in ref.items():
        m = _BLOCK_KEY.match(key)
        if m is None:
            continue
        kind = m.group(2)
        if kind == "topk":
            if v.dim() != 3 or v.shape[:2] != (1, t) or not _integer(v):
                raise refuse(key, f"integer [1, {t}, K]")
            continue
        if v.dim() < 3 or v.shape[:2] != (1, t) or not v.is_floating_point():
            raise refuse(key, f"floating [1, {t}, ...]")
        read.append(key)
    decoded, steps = ref.get("decoded_ids"), ref.get("decode_logits")
    if decoded is not None:
        bad_shape = decoded.dim() != 2 or decoded.shape[0] != 1 or decoded.numel() == 0
        if bad_shape or not _integer(decoded):
            raise refuse("decoded_ids", "integer [1, N]")
    if steps is not None:
        if steps.dim() != 2 or not steps.is_floating_point() or len(steps) == 0:
            raise refuse("decode_logits", "floating [steps >= 1, V]")
        if decoded is not None and decoded.shape[1] != len(steps) + 1:
            raise ValueError(
                f"reference-check: {file}: decode_logits has {len(steps)} rows, decoded_ids "
                f"{tuple(decoded.shape)} needs {decoded.shape[1] - 1} (one per decode step)"
            )
        read.append("decode_logits")
    one_shot = ref.get("prefill_of_decoded_logits")
    if one_shot is not None:
        if one_shot.dim() != 2 or one_shot.shape[0] != 1 or not one_shot.is_floating_point():
            raise refuse("prefill_of_decoded_logits", "floating [1, V]")
        read.append("prefill_of_decoded_logits")
    for key in read:
        bad = int((~torch.isfinite(ref[key])).sum())
        if bad:
            raise ValueError(
                f"reference-check: {file}: {key} holds {bad} non-finite value(s) (NaN or inf)"
            )


def reference_sensitivity(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The reference's own order sensitivity from the `summary.json` beside it, if any (a file
    that is not a JSON object is a ValueError naming it)."""
    summary = Path(path).parent / "summary.json"
    if not summary.is_file():
        return None
    try:
        doc = json.loads(summary.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"reference-check: {summary}: cannot be read as JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"reference-check: {summary}: not a JSON object")
    data = doc.get("order_sensitivity_vs_one_shot")
    return data if isinstance(data, dict) else None


def check_model_fits(model: DeepseekV41Model, ref: dict[str, Tensor]) -> None:
    cfg = model.config
    t = ref["input_ids"].shape[1]
    vocab = cfg.vocab_size
    for key in ("full_logits", "decode_logits", "prefill_of_decoded_logits"):
        if key in ref and ref[key].shape[-1] != vocab:
            raise ValueError(
                f"reference-check: {key} has {ref[key].shape[-1]} logits per token, the "
                f"checkpoint's vocab_size is {vocab}"
            )
    want = (1, t, cfg.hc_mult, cfg.hidden_size) if cfg.hc_mult > 1 else (1, t, cfg.hidden_size)
    for i in range(cfg.num_hidden_layers):
        out = ref.get(f"block{i}.out")
        if out is not None and tuple(out.shape) != want:
            raise ValueError(
                f"reference-check: block{i}.out is {tuple(out.shape)}, the model's streams "
                f"are {want}"
            )
        pre = ref.get(f"block{i}.pre_mix_in")
        if pre is not None and tuple(pre.shape) != (1, t, cfg.hc_mult):
            raise ValueError(
                f"reference-check: block{i}.pre_mix_in is {tuple(pre.shape)}, the model's "
                f"stream weights are {(1, t, cfg.hc_mult)}"
            )
        topk = ref.get(f"block{i}.topk")
        if topk is not None and topk.shape[-1] != cfg.index_topk:
            raise ValueError(
                f"reference-check: block{i}.topk is {tuple(topk.shape)}, the model selects "
                f"index_topk = {cfg.index_topk} entries per token"
            )
    for key in ("input_ids", "decoded_ids"):
        ids = ref.get(key)
        if ids is not None and (int(ids.max()) >= vocab or int(ids.min()) < 0):
            raise ValueError(f"reference-check: {key} outside [0, {vocab})")
