"""Helpers shared by the Triton kernels: the interpreter switch, the RNE cast and the bit-exact
rounding steps of the quantizers (power-of-two scales, e4m3)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# torch float dtypes the kernels load and store, and their Triton names
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def check_tl_dtype(t: torch.Tensor, what: str) -> None:
    """A ValueError naming `what` unless t's dtype is one the kernels load and store."""
    if t.dtype not in TL_DTYPES:
        taken = sorted(map(str, TL_DTYPES))
        raise ValueError(
            f"{what} must be one of {taken}, the dtypes these kernels take; got {t.dtype}"
        )


def check_out_dtype(dtype: torch.dtype, what: str) -> None:
    """A ValueError naming `what` unless the kernels can store `dtype` (fp32, bf16, fp16)."""
    if dtype not in TL_DTYPES:
        raise ValueError(f"{what}: out_dtype must be fp32, bf16 or fp16, got {dtype}")


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_flags(dtype: torch.dtype) -> dict[str, object]:
    """The tl.dot launch flags for operands of `dtype`: UPCAST (the CPU interpreter computes
    bf16/fp16 tl.dot wrongly — numpy has no bf16 — so the kernel casts to fp32 there), DOT_PREC
    ("ieee" for fp32 operands, else "tf32", which bf16/fp16 dots ignore) and RNE (the interpreter
    truncates fp32 → bf16; `to_dtype` rounds on the bits there)."""
    return {
        "UPCAST": interpreting() and dtype != torch.float32,
        "DOT_PREC": "ieee" if dtype == torch.float32 else "tf32",
        "RNE": interpreting(),
    }


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


@triton.jit
def pow2_ceil(v):
    """2^ceil(log2(v)) for v > 0 from the fp32 bits; a subnormal v gives 2^-126."""
    bits = v.to(tl.int32, bitcast=True)
    biased = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    biased = tl.minimum(tl.maximum(biased, 1), 254)
    return (biased << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_rne(v):
    """fp32 v with |v| ≤ 448 -> the nearest e4m3 value (ties to even), as fp32, sign kept."""
    mag = tl.abs(v)
    exponent = ((mag.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)  # e4m3 subnormals share the 2^-9 spacing
    ulp = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    # + 1.5·2^23 − 1.5·2^23 rounds mag/ulp (< 16, exact) to an integer, half to even
    rounded = ((mag / ulp + 12582912.0) - 12582912.0) * ulp
    # the sign bit copied, not negated: -(+0.0) may compile to 0 - 0 = +0 on the GPU
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
