"""Triton twins of the RoPE-only passes: `rope_index_queries` (ops.indexer) and `rope_tail_`
(ops.rope), the shared norm/RoPE row kernel (`kernels.norm_rope.norm_rope_rows`) with the norm
off, one read and one write of each row."""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4cp.kernels.norm_rope import norm_rope_rows
from dsv4cp.ops.indexer import check_index_query_proj
from dsv4cp.ops.quant import QuantMode, check_quant_mode
from dsv4cp.ops.rope import YarnScaling


def rope_index_queries(
    q_proj: Tensor,
    positions: Tensor,
    rope_dim: int,
    theta: float,
    yarn: YarnScaling | None = None,
    *,
    head_dim: int,
    quant: QuantMode = "none",
) -> Tensor:
    """Triton twin of ops.indexer.rope_index_queries: every (token, head) row roped (and under
    "qat" rounded, then fp4 per 32 fake-quantized) in one pass."""
    check_index_query_proj(q_proj, head_dim)
    t, heads = q_proj.shape[0], q_proj.shape[1] // head_dim
    out = torch.empty(t, heads, head_dim, dtype=q_proj.dtype, device=q_proj.device)
    norm_rope_rows(
        q_proj.reshape(t * heads, head_dim),
        out.view(t * heads, head_dim),
        positions=positions.repeat_interleave(heads),
        rope_dim=rope_dim,
        theta=theta,
        yarn=yarn,
        norm=False,
        fake_quant="fp4" if check_quant_mode(quant) == "qat" else None,
    )
    return out


def rope_tail_(
    x: Tensor,
    positions: Tensor,
    rope_dim: int,
    theta: float,
    yarn: YarnScaling | None = None,
    inverse: bool = False,
) -> Tensor:
    """Triton twin of ops.rope.rope_tail_: the last `rope_dim` dims of x [T, ..., D] rotated in
    place, one pass over the tail only (the row kernel with norm off, rows = T·heads); the
    torch op's chain of fp32 temporaries reads and writes the tail about ten times."""
    if x.dim() < 2 or positions.shape != (x.shape[0],):
        raise ValueError(
            f"rope_tail_: x must be [T, ..., D] and positions [T], got {tuple(x.shape)} and "
            f"{tuple(positions.shape)}"
        )
    d = x.shape[-1]
    if rope_dim <= 0 or rope_dim % 2 or rope_dim > d:
        raise ValueError(f"rope_tail_ kernel: rope_dim {rope_dim} must be even and in (0, {d}]")
    if x.numel() == 0:
        return x
    per_token = x[0].numel() // d  # rows (heads) per token
    try:
        rows = x.view(-1, d)  # every row of D values, in token-major order
    except RuntimeError:
        rows = None
    if rows is None or rows.stride(1) != 1:  # a layout the row view cannot take: via a copy
        y = x.contiguous()
        rope_tail_(y, positions, rope_dim, theta, yarn, inverse)
        return x.copy_(y)
    tail = rows[:, d - rope_dim :]
    pos = positions[:, None].expand(-1, per_token).reshape(-1) if per_token > 1 else positions
    norm_rope_rows(
        tail, tail, positions=pos, rope_dim=rope_dim, theta=theta, yarn=yarn, norm=False,
        inverse=inverse,
    )  # fmt: skip
    return x
