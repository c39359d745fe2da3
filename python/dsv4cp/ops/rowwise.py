"""A GEMM whose every output row is independent of the other rows in the call.

A plain GEMM's library kernel (and so its fp32 summation order) is chosen by the shape, the row
count M included: the same token gives last-bit different results in a one-shot prefill, a chunk
or a CP rank's share of the rows. Rounded to bf16 later, such a difference can flip a value.
`rowwise_linear_fp32` runs every call as the same fixed-shape tiles ([ROW_TILE, K] · [K, N],
zero rows padded, one batched GEMM), so a row's result depends only on the row: the row-local
fp32 mixes of the model (hyper-connection mix logits, MoE gate scores) are then bit-identical
under any CP split or chunking. Used only for those small-N GEMMs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

ROW_TILE = 64


def rowwise_linear_fp32(x: Tensor, w: Tensor, *, tile: int = ROW_TILE) -> Tensor:
    """fp32 x [..., K] · wᵀ → [..., N], each row computed by the same fixed-shape tile GEMM."""
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"rowwise_linear_fp32: x {tuple(x.shape)} and w {tuple(w.shape)}")
    rows = x.reshape(-1, x.shape[-1]).float()
    t = rows.shape[0]
    pad = -t % tile
    if pad:
        rows = F.pad(rows, (0, 0, 0, pad))
    tiles = rows.view(-1, tile, rows.shape[1])
    wt = w.float().t().unsqueeze(0).expand(tiles.shape[0], -1, -1)
    out = torch.bmm(tiles, wt).view(-1, w.shape[0])[:t]
    return out.view(*x.shape[:-1], w.shape[0])
