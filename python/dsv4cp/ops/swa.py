"""Sliding-window key: RMSNorm then RoPE in fp32, cast once (attention-math §4.3, §5.1)."""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4cp.ops.norm import rms_norm
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
) -> Tensor:
    """apply_rope(rms_norm(kv_raw)) [T, D] with no intermediate rounding; out_dtype or kv_raw's."""
    k = rms_norm(kv_raw, norm_weight, eps, out_dtype=torch.float32)
    k = apply_rope(k, positions, rope_dim, theta, yarn)
    return k.to(out_dtype or kv_raw.dtype)


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
) -> None:
    """Write cache[slots] = swa_key(...) cast to cache.dtype (writes `cache` in place)."""
    key = swa_key(kv_raw, positions, norm_weight, eps, rope_dim, theta, yarn, cache.dtype)
    cache.index_copy_(0, slots.long(), key)
