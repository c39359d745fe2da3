"""The workspace's row numbering for FlashMLA over the caches, in torch (twins of
`dsv4cp.kernels.workspace_rows`).

`kernels.flashmla.build_workspace` decodes each cache row that a chunk's indices name once into a
dense workspace: `mark_rows` marks the named rows, a prefix sum numbers them 0…n−1 in row order,
and `remap_rows` rewrites each index as its row's number plus the source's offset in the
workspace (−1 for an index outside the cache or a number past the workspace bound).
"""

from __future__ import annotations

import torch
from torch import Tensor


def mark_rows(idx: Tensor, mark: Tensor) -> None:
    """mark [n] (int32) = 1 at every index i of `idx` [t, K] with 0 ≤ i < n; others untouched."""
    n = mark.shape[0]
    valid = (idx >= 0) & (idx < n)
    # no boolean indexing (a host sync): invalid indices add max(·, 0) at row 0, a no-op
    mark.scatter_reduce_(
        0, torch.where(valid, idx, 0).long().flatten(), valid.int().flatten(), "amax"
    )


def remap_rows(idx: Tensor, number: Tensor, out: Tensor, base: int, bound: int) -> None:
    """out [t, K] (int32, may be a column slice) = number[i] + base for each index i of `idx`
    with 0 ≤ i < n = len(number) and number[i] < bound, else −1."""
    n = number.shape[0]
    valid = (idx >= 0) & (idx < n)
    num = number[idx.long().clamp(0, max(n - 1, 0))] if n else torch.zeros_like(idx)
    out.copy_(torch.where(valid & (num < bound), num + base, -1).to(torch.int32))
