"""Quantization modes; only "none" (bf16 / fp32 math, no fake quantization) is implemented."""

from __future__ import annotations

from enum import Enum


class QuantMode(str, Enum):
    NONE = "none"
    SGLANG_V4_LAYOUT = "sglang_v4_layout"
    REFERENCE_QAT = "reference_qat"


def check_quant_mode(mode: QuantMode | str) -> QuantMode:
    """Return the mode if it is implemented; raise NotImplementedError for the listed others."""
    try:
        parsed = QuantMode(mode)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in QuantMode)
        raise ValueError(f"unknown quant mode {mode!r}; expected one of {valid}") from None
    if parsed is not QuantMode.NONE:
        raise NotImplementedError(
            f"quant mode {parsed.value!r} is not implemented: only 'none' is; "
            f"{QuantMode.SGLANG_V4_LAYOUT.value!r} and {QuantMode.REFERENCE_QAT.value!r} are "
            "listed for later"
        )
    return parsed
