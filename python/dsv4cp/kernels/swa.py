"""Triton twins of `ops.swa`: the SWA key (attention-math §4.3/§5.1), norm + RoPE in fp32, cast
once, and under quant="qat" rounded to kv_raw's dtype after each step, then fp8 per 32
fake-quantized; `store_swa_k` scatters it to the cache slots. One pass of the shared norm/RoPE
row kernel (`kernels.norm_rope.norm_rope_rows`)."""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4cp.kernels.norm_rope import norm_rope_rows
from dsv4cp.ops.kv_format import KVFormat, row_width
from dsv4cp.ops.quant import QuantMode, check_quant_mode
from dsv4cp.ops.rope import YarnScaling
from dsv4cp.ops.swa import check_swa_rows_args


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
    """Triton twin of ops.swa.swa_key: norm and rope in fp32, one cast to out_dtype; "qat":
    rounded to kv_raw.dtype after each, then fp8 per 32 fake-quantized."""
    return swa_key_rows(
        kv_raw, positions, norm_weight, eps, rope_dim, theta, yarn, quant, "dense", out_dtype
    )


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
    """Triton twin of ops.swa.store_swa_k: writes cache[slots] in one pass over kv_raw."""
    qat = check_quant_mode(quant) == "qat"
    norm_rope_rows(
        kv_raw,
        cache,
        positions=positions,
        rope_dim=rope_dim,
        theta=theta,
        yarn=yarn,
        norm_weight=norm_weight,
        eps=eps,
        slots=slots,
        round_mid=qat,
        fake_quant="fp8" if qat else None,
        round_dtype=kv_raw.dtype,
    )


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
    """Triton twin of ops.swa.swa_key_rows: the stored rows from one pass (codes and ue8m0 scale
    bytes straight from the quantizer in registers when the rows are uint8)."""
    qat = check_swa_rows_args(fmt, quant)
    stored = stored_dtype or kv_raw.dtype
    encode = stored == torch.uint8 and fmt != "dense"
    t, d = kv_raw.shape
    out = torch.empty(t, row_width(fmt, d) if encode else d, dtype=stored, device=kv_raw.device)
    norm_rope_rows(
        kv_raw,
        out,
        positions=positions,
        rope_dim=rope_dim,
        theta=theta,
        yarn=yarn,
        norm_weight=norm_weight,
        eps=eps,
        round_mid=qat,
        fake_quant="fp8" if qat else None,
        encode=encode,
        round_dtype=kv_raw.dtype,
    )
    return out
