"""Helpers shared by the Triton kernels: the interpreter switch and the RNE cast."""

from __future__ import annotations

import os

import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def to_dtype(x, DTYPE: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """fp32 → DTYPE with round-to-nearest-even. The CPU interpreter truncates fp32 → bf16, so
    there the rounding is done on the bits first (the GPU cast is RNE already)."""
    if EMULATE_RNE:
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)
