"""Config field rules: each field of `DeepseekV41Config` declares its type and range once, on
the field (`ruled(rule)`); `checked` enforces it with a ValueError naming the field."""

from __future__ import annotations

import math
from dataclasses import MISSING, field
from typing import Any

# A tuple rule lists the allowed values.
SIZE, COUNT, LAYER = "size", "count", "layer"
POS, NONNEG, FLAG, IDS = "pos", "nonneg", "flag", "ids"
# A RoPE base: YaRN divides by log(theta), and a base ≤ 1 does not make decaying frequencies.
THETA = "theta"
_NUM_MIN = {POS: 0.0, NONNEG: 0.0, THETA: 1.0}  # exclusive for POS and THETA
_INT_MIN = {SIZE: 1, COUNT: 0, LAYER: -1}
_WHAT = {
    SIZE: "a positive integer",
    COUNT: "a non-negative integer",
    LAYER: "a layer id or -1",
    POS: "a positive finite number",
    NONNEG: "a non-negative finite number",
    THETA: "a finite number greater than 1",
    FLAG: "true or false",
    IDS: "a list of non-negative integers",
}


def ruled(rule: str | tuple[str, ...], default: Any = MISSING) -> Any:
    """A dataclass field obeying `rule`; without a default it is required in config.json. A
    None default makes the field optional (None is then not checked)."""
    return field(default=default, metadata={"rule": rule})


def bad_field(name: str, msg: str) -> ValueError:
    return ValueError(f"DeepseekV41Config.{name}: {msg}")


def is_int(v: object) -> bool:
    """An int that is not a bool (JSON's true/false arrive as bools)."""
    return isinstance(v, int) and not isinstance(v, bool)


def checked(name: str, v: Any, rule: str | tuple[str, ...]) -> Any:
    """v, normalised (numbers → float, lists → tuple), if it obeys `rule`; else ValueError."""
    if isinstance(rule, tuple):
        if v not in rule:
            raise bad_field(name, f"must be one of {rule}, got {v!r}")
        return v
    if rule == IDS:
        ok = isinstance(v, (list, tuple)) and all(is_int(i) and i >= 0 for i in v)
    elif rule == FLAG:
        ok = isinstance(v, bool)
    elif rule in _INT_MIN:
        ok = is_int(v) and v >= _INT_MIN[rule]
    else:
        ok = is_finite_number(v) and (v >= 0 if rule == NONNEG else v > _NUM_MIN[rule])
    if not ok:
        raise bad_field(name, f"must be {_WHAT[rule]}, got {v!r}")
    return tuple(v) if rule == IDS else float(v) if rule in _NUM_MIN else v


def is_finite_number(v: Any) -> bool:
    """An int or float (not a bool), neither NaN nor ±inf, nor an int too large for a float."""
    if not (is_int(v) or isinstance(v, float)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False
