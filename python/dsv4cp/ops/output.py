"""Grouped low-rank output projection (attention-math §4.7 steps 2-4)."""

from __future__ import annotations

import torch
from torch import Tensor


def grouped_output(o: Tensor, wo_a: Tensor, wo_b: Tensor, groups: int) -> Tensor:
    """y [T, d] = flatten(z) @ wo_bᵀ, z[t,g] = wo_a[g] · o[t, heads of g] rounded to o.dtype."""
    t, h, d = o.shape
    if h % groups:
        raise ValueError(f"grouped_output: {h} heads are not divisible into {groups} groups")
    width = h * d // groups
    if wo_a.dim() != 2 or wo_a.shape[0] % groups or wo_a.shape[1] != width:
        raise ValueError(
            f"grouped_output: wo_a must be [G*R_o, {width}] for G={groups}, got {tuple(wo_a.shape)}"
        )
    rank = wo_a.shape[0] // groups
    if wo_b.dim() != 2 or wo_b.shape[1] != groups * rank:
        raise ValueError(
            f"grouped_output: wo_b must be [d, {groups * rank}], got {tuple(wo_b.shape)}"
        )
    # In the activations' dtype: bf16 GEMMs accumulate in fp32 and round once (SGLang's bf16
    # einsum on SM90); upcasting the weights would cost a full fp32 copy per call.
    og = o.reshape(t, groups, width)
    wa = wo_a.to(o.dtype).view(groups, rank, width)
    z = torch.einsum("tgc,grc->tgr", og, wa)
    return z.flatten(1) @ wo_b.to(o.dtype).t()
