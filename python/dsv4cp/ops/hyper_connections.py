"""Manifold hyper-connections (mHC): ``hc_mult`` residual streams per token, and their mixes.

Every sublayer (attention, FFN) of a V4.1 block owns one mixing map ``fn [(2+H)·H, H·d]``,
``base [(2+H)·H]`` and ``scale [3]`` (H = ``hc_mult``). From the H streams entering it, it derives
three coefficient sets (DeepSeek reference ``model.py: Block.hc_mixes`` and
``kernel.py: hc_split_sinkhorn``):

- ``pre [H]``   = sigmoid(m_pre·scale₀ + base_pre) + eps     — collapses H streams into one input;
- ``post [H]``  = 2·sigmoid(m_post·scale₁ + base_post)       — spreads the sublayer output back;
- ``comb [H,H]``: softmax over each row of m_comb·scale₂ + base_comb, + eps, then Sinkhorn
  (column, then ``iters - 1`` rounds of row and column normalisation, each dividing by sum + eps).

``m = (fn @ flatten(x)) · rsqrt(mean(flatten(x)²) + norm_eps)`` (one RMS statistic over all H·d
values of a token). V4.1 collapses a sublayer's input with the ``pre`` of the *previous* sublayer
(one-hot on stream 0 before the first block) and hands its own ``pre`` on to the next one: see
``dsv4cp.layers.hyper_connections.hc_sublayer``. Everything here is per token (row-local), so
context parallelism cannot change it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from dsv4cp.ops.rowwise import rowwise_linear_fp32


class HcMixes(NamedTuple):
    """One sublayer's coefficients, fp32: pre [..., H], post [..., H], comb [..., H, H]."""

    pre: Tensor
    post: Tensor
    comb: Tensor


def _check_map(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor) -> int:
    if x.dim() < 2:
        raise ValueError(f"hc_mixes: x must be [..., hc_mult, d], got {tuple(x.shape)}")
    hc, d = x.shape[-2], x.shape[-1]
    mix = (2 + hc) * hc
    if tuple(fn.shape) != (mix, hc * d):
        raise ValueError(f"hc_mixes: fn must be [{mix}, {hc * d}], got {tuple(fn.shape)}")
    if tuple(base.shape) != (mix,):
        raise ValueError(f"hc_mixes: base must be [{mix}], got {tuple(base.shape)}")
    if tuple(scale.shape) != (3,):
        raise ValueError(f"hc_mixes: scale must be [3], got {tuple(scale.shape)}")
    return hc


def check_mix_args(x: Tensor, fn: Tensor) -> None:
    """hc_mix_logits' shapes (the op and its kernel twin): x [..., H, d], fn [N, H·d]."""
    if x.dim() < 2 or fn.dim() != 2 or fn.shape[1] != x.shape[-2] * x.shape[-1]:
        raise ValueError(
            f"hc_mix_logits: x must be [..., H, d] and fn [N, H·d], got {tuple(x.shape)} and "
            f"{tuple(fn.shape)}"
        )


def hc_mix_logits(x: Tensor, fn: Tensor, *, norm_eps: float) -> Tensor:
    """fp32 [..., (2+H)·H]: ``fn @ flatten(x)`` scaled by the token's rsqrt(mean(x²) + norm_eps)."""
    check_mix_args(x, fn)
    xf = x.flatten(-2).float()
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    return rowwise_linear_fp32(xf, fn) * rstd  # row-local bit for bit (CP, chunks)


def check_sinkhorn_args(
    logits: Tensor, scale: Tensor, base: Tensor, *, hc_mult: int, iters: int
) -> None:
    """sinkhorn_split's arguments (the op and its kernel twin): logits [..., (2+H)·H], scale [3],
    base [(2+H)·H], H = hc_mult >= 1, iters >= 1."""
    if iters < 1:
        raise ValueError(f"sinkhorn_split: hc_sinkhorn_iters must be >= 1, got {iters}")
    h = hc_mult
    if h < 1:
        raise ValueError(f"sinkhorn_split: hc_mult must be >= 1, got {h}")
    mix = (2 + h) * h
    if logits.dim() < 1 or logits.shape[-1] != mix:
        raise ValueError(
            f"sinkhorn_split: logits last dim must be {mix} for hc_mult={h}, "
            f"got shape {tuple(logits.shape)}"
        )
    if tuple(scale.shape) != (3,):
        raise ValueError(f"sinkhorn_split: scale must be [3], got {tuple(scale.shape)}")
    if tuple(base.shape) != (mix,):
        raise ValueError(f"sinkhorn_split: base must be [{mix}], got {tuple(base.shape)}")


def sinkhorn_split(
    logits: Tensor, scale: Tensor, base: Tensor, *, hc_mult: int, iters: int, eps: float
) -> HcMixes:
    """Split mix logits into pre / post / Sinkhorn-normalised comb, fp32 throughout.

    The operation order is the reference kernel's (``hc_split_sinkhorn``), so the result agrees
    with it to the last few fp32 ulps (``exp``/``sigmoid`` implementations may differ).
    """
    check_sinkhorn_args(logits, scale, base, hc_mult=hc_mult, iters=iters)
    h = hc_mult
    m, s, b = logits.float(), scale.float(), base.float()
    pre = torch.sigmoid(m[..., :h] * s[0] + b[:h]) + eps
    post = 2 * torch.sigmoid(m[..., h : 2 * h] * s[1] + b[h : 2 * h])
    comb = (m[..., 2 * h :] * s[2] + b[2 * h :]).unflatten(-1, (h, h))
    comb = torch.exp(comb - comb.amax(dim=-1, keepdim=True))
    comb = comb / comb.sum(dim=-1, keepdim=True) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return HcMixes(pre, post, comb)


def hc_mixes(
    x: Tensor,
    fn: Tensor,
    base: Tensor,
    scale: Tensor,
    *,
    norm_eps: float,
    sinkhorn_iters: int,
    hc_eps: float,
    mix_logits: Callable[..., Tensor] | None = None,
    split: Callable[..., HcMixes] | None = None,
) -> HcMixes:
    """The coefficients one sublayer derives from the streams x [..., H, d] that enter it.
    `mix_logits` / `split`: `hc_mix_logits` / `sinkhorn_split` or their kernel twins (the
    layer passes the routed ops; ops do not import routing)."""
    hc = _check_map(x, fn, base, scale)
    logits = (mix_logits or hc_mix_logits)(x, fn, norm_eps=norm_eps)
    return (split or sinkhorn_split)(
        logits, scale, base, hc_mult=hc, iters=sinkhorn_iters, eps=hc_eps
    )


def check_collapse_args(x: Tensor, pre: Tensor) -> None:
    """hc_collapse's shapes (the op and its kernel twin): pre [..., H] for x [..., H, d]."""
    if pre.shape != x.shape[:-1]:
        raise ValueError(
            f"hc_collapse: pre must be {tuple(x.shape[:-1])} for x {tuple(x.shape)}, "
            f"got {tuple(pre.shape)}"
        )


def check_expand_args(y: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> None:
    """hc_expand's shapes (the op and its kernel twin): y [..., d], residual [..., H, d],
    post [..., H], comb [..., H, H]."""
    if residual.shape[:-2] != y.shape[:-1] or residual.shape[-1] != y.shape[-1]:
        raise ValueError(
            f"hc_expand: residual {tuple(residual.shape)} does not match y {tuple(y.shape)}"
        )
    hc = residual.shape[-2]
    if post.shape != residual.shape[:-1] or comb.shape != (*residual.shape[:-1], hc):
        raise ValueError(
            f"hc_expand: post must be {tuple(residual.shape[:-1])} and comb "
            f"{(*residual.shape[:-1], hc)}, got {tuple(post.shape)} and {tuple(comb.shape)}"
        )


def hc_collapse(x: Tensor, pre: Tensor) -> Tensor:
    """Σ_i pre[..., i] · x[..., i, :] in fp32, rounded to x.dtype: [..., H, d] → [..., d]."""
    check_collapse_args(x, pre)
    return torch.sum(pre.float().unsqueeze(-1) * x.float(), dim=-2).to(x.dtype)


def hc_expand(y: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """New streams [..., H, d]: out[j] = post[j]·y + Σ_i comb[i, j]·residual[i], fp32 → y.dtype."""
    check_expand_args(y, residual, post, comb)
    spread = post.float().unsqueeze(-1) * y.float().unsqueeze(-2)
    mixed = torch.sum(comb.float().unsqueeze(-1) * residual.float().unsqueeze(-2), dim=-3)
    return (spread + mixed).to(y.dtype)


def hc_expand_embedding(h: Tensor, hc_mult: int) -> Tensor:
    """The H identical streams a block stack starts from: [..., d] → [..., H, d] (a copy)."""
    return h.unsqueeze(-2).repeat_interleave(hc_mult, dim=-2)


def identity_pre(like: Tensor, hc_mult: int) -> Tensor:
    """The ``pre`` the first block's attention collapses with: one-hot on stream 0, fp32
    [*like.shape, H]."""
    pre = torch.zeros(*like.shape, hc_mult, dtype=torch.float32, device=like.device)
    pre[..., 0] = 1.0
    return pre
