"""Rotary position embedding with optional YaRN scaling (attention-math §3).

Cos/sin are computed only for the positions asked for: there is never a table of
max_position_embeddings rows.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dsv4cp.rope_scaling import YarnScaling


def _check_rope_dim(rope_dim: int) -> None:
    if rope_dim <= 0 or rope_dim % 2:
        raise ValueError(f"rope_dim must be a positive even number, got {rope_dim}")


def _yarn_band(rope_dim: int, theta: float, yarn: YarnScaling) -> tuple[int, int]:
    def corr(n_rot: float) -> float:
        ratio = yarn.original_max_position / (2 * math.pi * n_rot)
        return rope_dim * math.log(ratio) / (2 * math.log(theta))

    lo = max(math.floor(corr(yarn.beta_fast)), 0)
    hi = min(math.ceil(corr(yarn.beta_slow)), rope_dim - 1)
    return lo, hi


def rope_inv_freq(
    rope_dim: int,
    theta: float,
    yarn: YarnScaling | None = None,
    *,
    device: torch.device | str | None = None,
) -> Tensor:
    """ω_i for i < rope_dim // 2, fp32, built directly on `device` (no host copy)."""
    _check_rope_dim(rope_dim)
    exponent = torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim
    freq = 1.0 / torch.pow(theta, exponent)
    if yarn is None:
        return freq
    lo, hi = _yarn_band(rope_dim, theta, yarn)
    span = (hi + 0.001 if lo == hi else hi) - lo
    i = torch.arange(rope_dim // 2, dtype=torch.float32, device=device)
    ramp = ((i - lo) / span).clamp(0.0, 1.0)
    return freq / yarn.factor * ramp + freq * (1.0 - ramp)


def rope_cos_sin(
    positions: Tensor,
    rope_dim: int,
    theta: float,
    yarn: YarnScaling | None = None,
) -> tuple[Tensor, Tensor]:
    """cos and sin of p·ω_i, fp32 [T, rope_dim // 2]; the angle is formed in fp32."""
    freq = rope_inv_freq(rope_dim, theta, yarn, device=positions.device)
    angle = positions.to(torch.float32)[..., None] * freq
    return torch.cos(angle), torch.sin(angle)


def apply_rope(
    x: Tensor,
    positions: Tensor,
    rope_dim: int,
    theta: float,
    yarn: YarnScaling | None = None,
    inverse: bool = False,
) -> Tensor:
    """Rotate interleaved pairs of the last `rope_dim` dims of x [T, ..., D] by exp(±i·p·ω)."""
    _check_rope_dim(rope_dim)
    if x.dim() < 2 or positions.shape != (x.shape[0],):
        raise ValueError(
            f"apply_rope: x must be [T, ..., D] and positions [T], got {tuple(x.shape)} and "
            f"{tuple(positions.shape)}"
        )
    dim = x.shape[-1]
    if rope_dim > dim:
        raise ValueError(f"apply_rope: rope_dim {rope_dim} exceeds the last dim {dim}")
    half = rope_dim // 2
    cos, sin = rope_cos_sin(positions, rope_dim, theta, yarn)
    if inverse:
        sin = -sin
    bshape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.view(bshape), sin.view(bshape)
    pairs = x[..., dim - rope_dim :].float().unflatten(-1, (half, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., : dim - rope_dim], rotated.to(x.dtype)), dim=-1)


def rope_tail_(
    x: Tensor,
    positions: Tensor,
    rope_dim: int,
    theta: float,
    yarn: YarnScaling | None = None,
    inverse: bool = False,
) -> Tensor:
    """In-place `apply_rope`: rotates the last `rope_dim` dims of x and returns x, the other dims
    untouched (1/8 of the traffic of a functional copy at D = 512). Same numerics."""
    tail = x[..., x.shape[-1] - rope_dim :]
    tail.copy_(apply_rope(tail, positions, rope_dim, theta, yarn, inverse=inverse))
    return x
