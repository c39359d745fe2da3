"""Sliding-window key: RMSNorm then RoPE (attention-math §4.3, §5.1), and under quant="qat" the
reference's fp8 step (DeepSeek-V4.1 `inference/model.py`, `Attention._window_kv`)."""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4cp.ops.attention_quant import fake_quant_swa_key_fp8
from dsv4cp.ops.kv_format import KVFormat, check_format, stored_rows
from dsv4cp.ops.norm import rms_norm
from dsv4cp.ops.quant import QuantMode, check_quant_mode
from dsv4cp.ops.rope import YarnScaling, apply_rope


def swa_key(
    kv_raw: Tensor,
    positions: Tensor,
    norm_weight: Tensor | None,
    eps: float,
    rope_dim: int,
    theta: float,
    yarn: YarnScaling | None = None,
    out_dtype: torch.dtype | None = None,
    quant: QuantMode = "none",
) -> Tensor:
    """The SWA key [T, D] in out_dtype (default kv_raw's).

    "none": apply_rope(rms_norm(kv_raw)) in fp32, one rounding at the end.
    "qat": the reference's steps, each rounded to kv_raw.dtype (its activation dtype): the norm,
    then RoPE on the tail, then all D dims fp8 e4m3 per 32 with ue8m0 scales, dequantized
    (`fake_quant_swa_key_fp8`). The result is exact in any dtype at least as wide as kv_raw's.
    """
    if check_quant_mode(quant) == "qat":
        k = _qat_key(kv_raw, positions, norm_weight, eps, rope_dim, theta, yarn)
        return fake_quant_swa_key_fp8(k).to(out_dtype or kv_raw.dtype)
    k = rms_norm(kv_raw, norm_weight, eps, out_dtype=torch.float32)
    k = apply_rope(k, positions, rope_dim, theta, yarn)
    return k.to(out_dtype or kv_raw.dtype)


def _qat_key(
    kv_raw: Tensor,
    positions: Tensor,
    norm_weight: Tensor | None,
    eps: float,
    rope_dim: int,
    theta: float,
    yarn: YarnScaling | None,
) -> Tensor:
    """The qat SWA key before its fp8 step: the norm and RoPE each rounded to kv_raw.dtype."""
    k = rms_norm(kv_raw, norm_weight, eps)
    return apply_rope(k, positions, rope_dim, theta, yarn)


def store_swa_k(
    kv_raw: Tensor,
    positions: Tensor,
    slots: Tensor,
    cache: Tensor,
    norm_weight: Tensor | None,
    eps: float,
    rope_dim: int,
    theta: float,
    yarn: YarnScaling | None = None,
    quant: QuantMode = "none",
) -> None:
    """Write cache[slots] = swa_key(...) cast to cache.dtype (writes `cache` in place)."""
    key = swa_key(kv_raw, positions, norm_weight, eps, rope_dim, theta, yarn, cache.dtype, quant)
    cache.index_copy_(0, slots.long(), key)


def check_swa_rows_args(fmt: KVFormat, quant: QuantMode) -> bool:
    """ValueError unless an SWA cache of numerics `fmt` can hold keys of `quant` (the kernel and
    the twin of `swa_key_rows` both call this); returns whether quant is qat."""
    if check_format(fmt) not in ("dense", "fp8_ue8m0_32"):
        raise ValueError(f"swa_key_rows: the SWA cache is dense or fp8_ue8m0_32, got {fmt}")
    qat = check_quant_mode(quant) == "qat"
    if fmt != "dense" and not qat:
        raise ValueError("swa_key_rows: a quantized SWA cache needs quant='qat'")
    return qat


def swa_key_rows(
    kv_raw: Tensor,
    positions: Tensor,
    norm_weight: Tensor | None,
    eps: float,
    rope_dim: int,
    theta: float,
    yarn: YarnScaling | None = None,
    quant: QuantMode = "none",
    fmt: KVFormat = "dense",
    stored_dtype: torch.dtype | None = None,
) -> Tensor:
    """The SWA keys as a cache of numerics `fmt` keeps them in a `stored_dtype` tensor (default
    kv_raw's): `stored_rows(swa_key(...))`, except that codes come from quantizing the key once,
    before its fake quant (re-quantizing the fake-fp8 key gives the same values, but half the
    scale and double codes in a block whose top code rounded to 224; docs/caches.md)."""
    check_swa_rows_args(fmt, quant)
    stored = stored_dtype or kv_raw.dtype
    if fmt != "dense" and stored == torch.uint8:
        key = _qat_key(kv_raw, positions, norm_weight, eps, rope_dim, theta, yarn)
        return stored_rows(key, fmt, stored)
    key = swa_key(kv_raw, positions, norm_weight, eps, rope_dim, theta, yarn, stored, quant)
    return stored_rows(key, fmt, stored)
