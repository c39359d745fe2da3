"""Grouped low-rank output projection (attention-math §4.7 steps 2-4)."""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4cp.ops.matmul import linear_rows, pad_rows_cpu


def grouped_wo_a(o: Tensor, wo_a: Tensor, groups: int) -> Tensor:
    """z [T, G·R_o], z[t,g] = wo_a[g] · o[t, heads of g], in o.dtype (reference
    `Attention.forward`: a bf16 einsum, fp32 accumulation, one rounding)."""
    t, h, d = o.shape
    if h % groups:
        raise ValueError(f"grouped_output: {h} heads are not divisible into {groups} groups")
    width = h * d // groups
    if wo_a.dim() != 2 or wo_a.shape[0] % groups or wo_a.shape[1] != width:
        raise ValueError(
            f"grouped_output: wo_a must be [G*R_o, {width}] for G={groups}, got {tuple(wo_a.shape)}"
        )
    # In the activations' dtype: bf16 GEMMs accumulate in fp32 and round once (SGLang's bf16
    # einsum on SM90); upcasting the weights would cost a full fp32 copy per call.
    # One bmm over the groups written straight into z's [T, G, R_o] layout (cuBLAS takes the
    # strided output; einsum would add a permuting copy of z: 0.34 ms at 16K tokens on the H200).
    r_o = wo_a.shape[0] // groups
    rows, t = pad_rows_cpu(o.reshape(t, groups * width))  # CPU: row-local (ops.matmul)
    og = rows.reshape(-1, groups, width).transpose(0, 1)
    wa = wo_a.to(o.dtype).view(groups, r_o, width).transpose(1, 2)
    z = o.new_empty(rows.shape[0], groups * r_o)
    torch.bmm(og, wa, out=z.view(-1, groups, r_o).transpose(0, 1))
    return z[:t]


def grouped_output(o: Tensor, wo_a: Tensor, wo_b: Tensor, groups: int) -> Tensor:
    """y [T, d] = flatten(z) @ wo_bᵀ, z[t,g] = wo_a[g] · o[t, heads of g] rounded to o.dtype."""
    z = grouped_wo_a(o, wo_a, groups)
    if wo_b.dim() != 2 or wo_b.shape[1] != z.shape[1]:
        raise ValueError(f"grouped_output: wo_b must be [d, {z.shape[1]}], got {tuple(wo_b.shape)}")
    return linear_rows(z, wo_b.to(o.dtype))
