"""The workspace's row numbering for FlashMLA over the caches, in torch (twins of
`dsv4cp.kernels.workspace_rows`).

`kernels.attention_workspace.build_workspace` decodes each cache row that a chunk's indices name
once into a dense workspace: `mark_rows` marks the named rows, a prefix sum of the marks counts
them (a marked row's number is its count − 1: 0…n−1 in row order), `place_rows` lists each
workspace row's cache row, and `remap_rows` rewrites each index as its row's number plus the
source's offset in the workspace (−1 for an index outside the cache or a number past the
workspace bound).

A source can also be numbered densely (`invert_rows`): every row of a given list (the batch's
compressed entries) gets a workspace row, named or not, so the numbering does not depend on the
indices, and `remap_rows` reads the inverted list in place of the count.

`WorkspaceMemo` keeps the last workspace built for the next layer of the forward whose indices
are the same tensors, or, for a densely numbered source, whose row list is the same tensor
(`context.AttentionMemo`): its numbering is reused (a dense source's indices remapped again),
the SWA source (each layer's own cache) is decoded again into its rows, the compressed rows only
if their cache differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class WorkspaceMemo:
    """The last workspace `kernels.attention_workspace.build_workspace` built: per source the
    index tensor it numbered, the cache it decoded and the format (`sources`), its row span in
    `kv` and the cache row of each workspace row (`spans`, `src`); per densely numbered source
    the row list and its inversion (`dense`, `number`; None for a source numbered from its
    indices); the remapped indices and the query rows. One entry: a build that fits no held
    numbering replaces it."""

    sources: list[tuple[Tensor, Tensor, str]] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # (base, bound) in kv
    src: list[Tensor] = field(default_factory=list)  # [bound] int32 cache rows, −1 none
    dense: list[Tensor | None] = field(default_factory=list)  # the row list numbered densely
    number: list[Tensor | None] = field(default_factory=list)  # its `invert_rows`
    kv: Tensor | None = None
    indices: Tensor | None = None
    rows: tuple[int, int] = (0, 0)

    def hold(self, kv: Tensor, indices: Tensor, rows: tuple[int, int]) -> None:
        """Start holding a new workspace (its sources are appended as they are numbered)."""
        self.sources, self.spans, self.src, self.dense, self.number = [], [], [], [], []
        self.kv, self.indices, self.rows = kv, indices, rows

    def same_numbering(
        self,
        indices: list[Tensor],
        bounds: list[int],
        rows: tuple[int, int],
        d: int,
        dense: list[Tensor | None] | None = None,
    ) -> bool:
        """True when the held workspace numbers these sources alike (the same bounds, query rows
        and row width): a source numbered from its indices, by the very index tensor; a densely
        numbered one, by the very row list (`dense`, None per source numbered from indices)."""
        if self.kv is None or rows != self.rows or d != self.kv.shape[1]:
            return False
        if bounds != [b for _, b in self.spans]:
            return False
        lists = dense if dense is not None else [None] * len(indices)
        if len(lists) != len(indices) or len(self.dense) != len(indices):
            return False
        for a, held, rows_now, rows_held in zip(indices, self.sources, lists, self.dense):
            if rows_now is not None or rows_held is not None:
                if rows_now is not rows_held:
                    return False
            elif a is not held[0]:
                return False
        return True


def same_rows(a: Tensor, b: Tensor) -> bool:
    """The same cache: one storage, offset, shape, strides and dtype (a fresh view of it too)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def mark_rows(idx: Tensor, mark: Tensor) -> None:
    """mark [n] (int32) = 1 at every index i of `idx` [t, K] with 0 ≤ i < n; others untouched."""
    n = mark.shape[0]
    valid = (idx >= 0) & (idx < n)
    # no boolean indexing (a host sync): invalid indices add max(·, 0) at row 0, a no-op
    mark.scatter_reduce_(
        0, torch.where(valid, idx, 0).long().flatten(), valid.int().flatten(), "amax"
    )


def place_rows(count: Tensor, src: Tensor) -> None:
    """src [bound] (int32) = the cache row numbered j (marked, count − 1 = j) at each j below the
    marked rows' total, −1 at every later j; `count` [n] (int32) is the inclusive prefix sum of
    the marks, so row i is marked where count[i] > count[i − 1] (count[−1] read as 0)."""
    n, bound = count.shape[0], src.shape[0]
    prev = torch.cat([count.new_zeros(1), count[:-1]])
    number = count.long() - 1
    at = torch.where((count > prev) & (number < bound), number, bound)
    out = torch.full((bound + 1,), -1, dtype=torch.int32, device=count.device)
    out.scatter_(0, at, torch.arange(n, dtype=torch.int32, device=count.device))
    src.copy_(out[:bound])


def invert_rows(rows: Tensor, n: int) -> Tensor:
    """The dense numbering of a row list: number [n] (int32) = j at rows[j] (0 ≤ rows[j] < n),
    len(rows) at every row not listed, so `remap_rows(idx, number, out, base, len(rows))` maps
    a listed row to its place plus `base` and any other index to −1. Listed rows are distinct
    (the batch's compressed entries: one cache row each)."""
    bound = rows.shape[0]
    number = torch.full((n + 1,), bound, dtype=torch.int32, device=rows.device)
    at = torch.where((rows >= 0) & (rows < n), rows.long(), n)  # unlisted slots land on row n
    number.scatter_(0, at, torch.arange(bound, dtype=torch.int32, device=rows.device))
    return number[:n]


def remap_rows(idx: Tensor, number: Tensor, out: Tensor, base: int, bound: int) -> None:
    """out [t, K] (int32, may be a column slice) = number[i] + base for each index i of `idx`
    with 0 ≤ i < n = len(number) and number[i] < bound, else −1."""
    n = number.shape[0]
    valid = (idx >= 0) & (idx < n)
    num = number[idx.long().clamp(0, max(n - 1, 0))] if n else torch.zeros_like(idx)
    out.copy_(torch.where(valid & (num < bound), num + base, -1).to(torch.int32))
