"""A GEMM whose every output row is independent of the other rows in the call.

A plain GEMM's library kernel (and so its fp32 summation order) is chosen by the shape, the row
count M included: the same token gives last-bit different results in a one-shot prefill, a chunk
or a CP rank's share of the rows. Rounded to bf16 later, such a difference can flip a value.
`rowwise_linear_fp32` runs every call as batched GEMMs of one fixed shape ([CALL_TILES ×
ROW_TILE, K] · [K, N] as CALL_TILES tiles, zero rows padded), so a row's result depends only on
the row: the row-local fp32 mixes of the model (hyper-connection mix logits, MoE gate scores)
are then bit-identical under any CP split or chunking. Used only for those small-N GEMMs.

The batch count is fixed too: cuBLAS may also pick its algorithm by the number of batched
tiles. With one bmm over all tiles (the earlier form), the H200 gave CP 1 and CP 2 (3 and 2 tiles
per call) bit-identical results on the tiny fixture but CP 3 and CP 4 (one tile) 2e-7 apart, and
in qat that moved a top-k entry; with the fixed shape, `check --cp 4 --quant qat` on the H200 is
bit-identical to CP 1 (fake ranks and gloo processes, serial and multistream).

On CUDA the routed kernel twin (`kernels/rowwise.py`) replaces the per-call loop: a Triton GEMM
whose K loop never depends on the row count, row-local by construction.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

ROW_TILE = 64
CALL_TILES = 4  # tiles per batched GEMM: every call has this one shape


def check_rowwise_args(x: Tensor, w: Tensor) -> None:
    """rowwise_linear_fp32's shapes (the op and its kernel twin): w [N, K] for x [..., K]."""
    if w.dim() != 2 or x.dim() < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"rowwise_linear_fp32: x {tuple(x.shape)} and w {tuple(w.shape)}")


def rowwise_linear_fp32(x: Tensor, w: Tensor) -> Tensor:
    """fp32 x [..., K] · wᵀ → [..., N], each row computed by the same fixed-shape batched GEMM."""
    check_rowwise_args(x, w)
    rows = x.reshape(-1, x.shape[-1]).float()
    t, k, n = rows.shape[0], rows.shape[1], w.shape[0]
    per_call = ROW_TILE * CALL_TILES
    if t == 0:
        return rows.new_empty(*x.shape[:-1], n)
    pad = -t % per_call
    if pad:
        rows = F.pad(rows, (0, 0, 0, pad))
    wt = w.float().t().unsqueeze(0).expand(CALL_TILES, -1, -1)
    out = rows.new_empty(rows.shape[0], n)
    for a in range(0, rows.shape[0], per_call):
        chunk = rows[a : a + per_call].view(CALL_TILES, ROW_TILE, k)
        torch.bmm(chunk, wt, out=out[a : a + per_call].view(CALL_TILES, ROW_TILE, n))
    return out[:t].view(*x.shape[:-1], n)
