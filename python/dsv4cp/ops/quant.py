"""fp8 e4m3 / fp4 e2m1 block quantizers with DeepSeek-V4.1's reference numerics (pure torch).

`quant="qat"` reproduces the reference inference code bit for bit: DeepSeek-V4.1-Flash
`inference/kernel.py` (torch port: tt-metal `reference/deepseek_v41/kernel_cpu.py`, functions
`act_quant`, `fp4_act_quant`, `fast_round_scale`, `unpack_fp4`, `pack_fp4`). docs/quantization.md
lists where each quantizer sits in the model.

Conventions shared by every quantizer here:
- the input is grouped along its last dim in blocks of `block`; any float dtype is accepted and
  read as fp32 (the reference takes bf16 only: on bf16 input the results are bit-identical);
- scales come back as float32 tensors [..., K // block] holding values that the storage scale
  format represents exactly (ue8m0: powers of two; e4m3: e4m3 values), so converting them with
  `.to(torch.float8_e8m0fnu)` or `.to(torch.float8_e4m3fn)` is lossless;
- fp8 codes come back as float8_e4m3fn; fp4 codes as uint8 [..., K // 2], two e2m1 codes per byte,
  the even element in the low nibble (the checkpoint's packing), bit 3 of a code = sign;
- `fake_*` variants return the dequantized values in x.dtype (the reference's in-place mode);
- inputs must be finite (NaN/inf in a block make that block's output undefined).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

QuantMode = Literal["none", "qat"]
QUANT_MODES: tuple[QuantMode, ...] = get_args(QuantMode)
# Declared modes that are not implemented yet (attention-math §9): asking for one raises.
_LATER_MODES = {"sglang_v4_layout": "SGLang's V4 cache layout (fp8 nope per 64 + bf16 rope)"}

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
# amax floors of the reference kernels: they keep every scale finite and nonzero
FP8_AMAX_FLOOR = 1e-4
FP4_UE8M0_AMAX_FLOOR = 6 * 2.0**-126
FP4_E4M3_AMAX_FLOOR = 6 * 2.0**-9
# the kernels multiply amax by these fp32 reciprocals (not a division) for ue8m0 scales
_INV_FP8_MAX = 1.0 / FP8_E4M3_MAX
_INV_FP4_MAX = 1.0 / FP4_E2M1_MAX


def check_quant_mode(mode: str) -> QuantMode:
    """Return `mode` if it is one of QUANT_MODES; NotImplementedError for a declared later mode,
    ValueError naming the allowed values otherwise."""
    if mode in QUANT_MODES:
        return mode
    if mode in _LATER_MODES:
        raise NotImplementedError(
            f"quant mode {mode!r} ({_LATER_MODES[mode]}) is not implemented; "
            f"implemented: {', '.join(map(repr, QUANT_MODES))}"
        )
    raise ValueError(
        f"unknown quant mode {mode!r}; expected one of {', '.join(map(repr, QUANT_MODES))}"
    )


def _blocks(x: Tensor, block: int, what: str) -> Tensor:
    """x [..., K] -> fp32 [..., K // block, block]."""
    if not x.is_floating_point():
        raise ValueError(f"{what}: x must be a float tensor, got {x.dtype}")
    if block <= 0 or x.shape[-1] % block:
        raise ValueError(f"{what}: last dim {x.shape[-1]} is not a multiple of block={block}")
    return x.float().unflatten(-1, (-1, block))


def pow2_ceil(v: Tensor) -> Tensor:
    """fp32 2^ceil(log2(v)) for v > 0, exponent clamped to [-126, 127] (a subnormal v maps to
    2^-126, as the reference's exponent-bit rounding `fast_round_scale` does)."""
    mant, exp = torch.frexp(v.float())  # v = mant · 2^exp, mant ∈ [0.5, 1)
    exp = (exp - (mant == 0.5).to(exp.dtype)).clamp(-126, 127)
    return ((exp + 127) << 23).view(torch.float32)


def e8m0_to_float(s: Tensor) -> Tensor:
    """ue8m0 scales (float8_e8m0fnu, or raw uint8 bits) -> float32 2^(bits-127); 0xFF -> NaN."""
    if s.dtype == torch.float8_e8m0fnu:
        s = s.view(torch.uint8)
    elif s.dtype != torch.uint8:
        raise ValueError(f"e8m0_to_float: expected float8_e8m0fnu or uint8, got {s.dtype}")
    bits = s.to(torch.int32)
    out = (bits << 23).view(torch.float32)
    out = torch.where(bits == 0, 2.0**-127, out)  # biased exponent 0 is the subnormal 2^-127
    return torch.where(bits == 255, float("nan"), out)


def scale_to_float(s: Tensor) -> Tensor:
    """A checkpoint or quantizer scale tensor (e8m0, e4m3 or any float) as float32 values."""
    if s.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return e8m0_to_float(s)
    if not s.is_floating_point():
        raise ValueError(f"scale: expected a float or e8m0 tensor, got {s.dtype}")
    return s.float()


def _e4m3_saturating(v: Tensor) -> Tensor:
    """fp32 -> float8_e4m3fn, round-to-nearest-even, saturating at ±448 (`satfinite`)."""
    return v.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


# ---- fp8 e4m3 activations, ue8m0 scale per block --------------------------------------------


def _fp8_codes_and_scales(x: Tensor, block: int, what: str) -> tuple[Tensor, Tensor]:
    xb = _blocks(x, block, what)
    amax = xb.abs().amax(dim=-1).clamp_min(FP8_AMAX_FLOOR)
    scale = pow2_ceil(amax * torch.tensor(_INV_FP8_MAX, dtype=torch.float32))
    return _e4m3_saturating(xb / scale.unsqueeze(-1)), scale


def act_quant_fp8(x: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """x [..., K] -> (float8_e4m3fn codes [..., K], fp32 power-of-two scales [..., K // block]).

    Per block: amax floored at 1e-4, scale 2^⌈log2(amax · fp32(1/448))⌉, codes
    e4m3_rne(clamp(x / scale, ±448)). Reference: kernel_cpu.py `act_quant(scale_fmt="ue8m0")`.
    """
    codes, scale = _fp8_codes_and_scales(x, block, "act_quant_fp8")
    return codes.flatten(-2), scale


def fake_act_quant_fp8(
    x: Tensor, block: int = 32, *, out_dtype: torch.dtype | None = None
) -> Tensor:
    """act_quant_fp8 then dequantized (codes · scale), in out_dtype, default x.dtype (reference:
    inplace=True); exact in bf16 and fp32 (an e4m3 code times a power of two)."""
    codes, scale = _fp8_codes_and_scales(x, block, "fake_act_quant_fp8")
    return (codes.float() * scale.unsqueeze(-1)).flatten(-2).to(out_dtype or x.dtype)


# ---- fp4 e2m1 values and codes --------------------------------------------------------------


def e2m1_round(v: Tensor) -> Tensor:
    """fp32 v with |v| ≤ 6 -> nearest e2m1 value (round half to even code), fp32, sign of zero kept.

    The e2m1 grid has spacing 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]; rounding v / spacing half
    to even picks the even code at every midpoint (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4).
    """
    mag = v.abs()
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    return torch.round(v / step) * step


def _e2m1_codes(values: Tensor) -> Tensor:
    """Exact e2m1 values (fp32) -> uint8 codes 0..15 (bit 3 = sign, -0.0 -> 8)."""
    mag = values.abs()
    index = torch.where(mag < 2, mag * 2, torch.where(mag < 4, mag + 2, mag / 2 + 4))
    return index.to(torch.uint8) | (torch.signbit(values).to(torch.uint8) << 3)


def unpack_fp4(packed: Tensor) -> Tensor:
    """Packed fp4 (int8 / uint8 / float4_e2m1fn_x2) [..., n/2] -> fp32 e2m1 values [..., n];
    the even element is the low nibble."""
    if packed.dtype not in (torch.int8, torch.uint8, torch.float4_e2m1fn_x2):
        raise ValueError(
            f"unpack_fp4: expected int8, uint8 or float4_e2m1fn_x2, got {packed.dtype}"
        )
    byte = packed.view(torch.uint8).to(torch.int32)
    codes = torch.stack([byte & 0xF, byte >> 4], dim=-1).flatten(-2)
    exponent, mantissa = (codes >> 1) & 3, (codes & 1).float()
    scale = torch.exp2((exponent - 2).float())
    mag = torch.where(exponent == 0, mantissa * 0.5, (2 + mantissa) * scale)
    return torch.where(codes >= 8, -mag, mag)


def pack_fp4(values: Tensor) -> Tensor:
    """Exact e2m1 values [..., n] (n even) -> uint8 [..., n/2], even element in the low nibble.

    ValueError if a value is not on the e2m1 grid (|v| ≤ 6, spacing as in `e2m1_round`).
    """
    if values.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim {values.shape[-1]} must be even")
    v = values.float()
    if not bool(((v.abs() <= FP4_E2M1_MAX) & (e2m1_round(v.clamp(-6, 6)) == v)).all()):
        raise ValueError("pack_fp4: values must be exact e2m1 values (0, ±0.5, ±1, … ±6)")
    return _pack_codes(_e2m1_codes(v))


def _pack_codes(codes: Tensor) -> Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


# ---- fp4 with a ue8m0 scale per block (indexer q and k) ------------------------------------


def _fp4_ue8m0(x: Tensor, block: int, what: str) -> tuple[Tensor, Tensor]:
    xb = _blocks(x, block, what)
    amax = xb.abs().amax(dim=-1).clamp_min(FP4_UE8M0_AMAX_FLOOR)
    scale = pow2_ceil(amax * torch.tensor(_INV_FP4_MAX, dtype=torch.float32))
    v = (xb / scale.unsqueeze(-1)).clamp(-FP4_E2M1_MAX, FP4_E2M1_MAX)
    return e2m1_round(v), scale


def fp4_quant(x: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """x [..., K] -> (packed uint8 e2m1 codes [..., K // 2], fp32 power-of-two scales
    [..., K // block]).

    Per block: amax floored at 6·2^-126, scale 2^⌈log2(amax · fp32(1/6))⌉, codes
    e2m1_rne(clamp(x / scale, ±6)). Reference: kernel_cpu.py `fp4_act_quant` (e8m0 scales).
    """
    values, scale = _fp4_ue8m0(x, block, "fp4_quant")
    return _pack_codes(_e2m1_codes(values.flatten(-2))), scale


def fake_fp4_quant(x: Tensor, block: int = 32) -> Tensor:
    """fp4_quant then dequantized, in x.dtype (reference: fp4_act_quant inplace=True)."""
    values, scale = _fp4_ue8m0(x, block, "fake_fp4_quant")
    return (values * scale.unsqueeze(-1)).flatten(-2).to(x.dtype)


# ---- fp4 with an e4m3 scale per block (compressed attention key) ---------------------------


def _fp4_e4m3(x: Tensor, block: int, what: str) -> tuple[Tensor, Tensor]:
    xb = _blocks(x, block, what)
    amax = xb.abs().amax(dim=-1).clamp_min(FP4_E4M3_AMAX_FLOOR)
    scale = _e4m3_saturating(amax / FP4_E2M1_MAX).float()  # IEEE division here, not 1/6
    v = (xb / scale.unsqueeze(-1)).clamp(-FP4_E2M1_MAX, FP4_E2M1_MAX)
    return e2m1_round(v), scale


def fp4_quant_e4m3_scale(x: Tensor, block: int = 16) -> tuple[Tensor, Tensor]:
    """x [..., K] -> (packed uint8 e2m1 codes [..., K // 2], fp32 scales [..., K // block] that
    are e4m3 values).

    Per block: amax floored at 6·2^-9, scale e4m3_rne(amax / 6) (≥ 2^-9, may be subnormal e4m3),
    codes e2m1_rne(clamp(x / scale, ±6)). Reference: kernel_cpu.py `fp4_act_quant`
    (scale_dtype=float8_e4m3fn), used by model.py `Attention._compress_kv` with block 16.
    """
    values, scale = _fp4_e4m3(x, block, "fp4_quant_e4m3_scale")
    return _pack_codes(_e2m1_codes(values.flatten(-2))), scale


def fake_fp4_quant_e4m3_scale(x: Tensor, block: int = 16) -> Tensor:
    """fp4_quant_e4m3_scale then dequantized, in x.dtype."""
    values, scale = _fp4_e4m3(x, block, "fake_fp4_quant_e4m3_scale")
    return (values * scale.unsqueeze(-1)).flatten(-2).to(x.dtype)
