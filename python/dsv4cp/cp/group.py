"""What the model sees of context parallelism: the `CPGroup` protocol, its errors, the input
checks every backend shares, `SingleCPGroup`, and `gather_global`, the one gather.

`all_gather(x [P, ...], tag=...)` returns [cp·P, ...] rank-major and is issued on the CURRENT
stream (never on a side stream: docs/invariants.md, invariant 1). Every rank must pass the same
shape; the caller pads with `CPLayout.shard`. `tag` names the tensor ("layer3/swa_rows") for the
order guard and for error messages.

`all_to_all(x, splits, tag=...)` sends rows of x to every rank: `splits[i][j]` is the number of
rows rank i sends to rank j, and every rank passes the same matrix (the send counts of every
rank, from `split_matrix`: an all_gather of the counts plus one host read). x holds this rank's
`sum(splits[rank])` rows grouped by destination; the result holds `sum(splits[i][rank] for i)`
rows grouped by source rank (rank-major). Expert parallelism's dispatch and combine
(docs/ep.md). Also on the current stream.

Backends: `SingleCPGroup` (cp_size 1, here), `TorchDistCPGroup` (`cp/dist.py`: NCCL on GPU, gloo
on CPU) and `FakeCPWorld` / `FakeCPGroup` (`cp/fake.py`: every rank a thread of one process).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from dsv4cp.cp.layout import CPLayout

__all__ = [
    "CPCommError",
    "CPGroup",
    "CPRankFailedError",
    "CPTimeoutError",
    "SingleCPGroup",
    "check_cp_size",
    "check_input",
    "check_splits",
    "check_timeout",
    "gather_global",
    "split_matrix",
]


class CPCommError(RuntimeError):
    """A CP collective failed: bad input, a dead or failed peer, a backend error."""


class CPTimeoutError(CPCommError, TimeoutError):
    """A CP collective did not complete within the group's timeout."""


class CPRankFailedError(CPCommError):
    """A collective was abandoned because another rank failed or finished early (fake world)."""


@runtime_checkable
class CPGroup(Protocol):
    """What the model sees of context parallelism.

    `capturable`: True when `all_gather` can be captured into a CUDA graph (NCCL, or no
    collective at all). The graph runner puts the gathers of other groups behind eager breaks.
    `all_to_all` with a fixed split matrix is capturable on the same groups; its split matrix
    comes from a host read (`split_matrix`), which no capture allows (docs/ep.md).
    """

    capturable: bool

    @property
    def cp_size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    def all_gather(self, x: Tensor, *, tag: str) -> Tensor:
        """x [P, ...] (same shape on every rank) → [cp·P, ...] rank-major, current stream."""
        ...

    def all_to_all(self, x: Tensor, splits: Sequence[Sequence[int]], *, tag: str) -> Tensor:
        """x [Σ_j splits[rank][j], ...] grouped by destination → [Σ_i splits[i][rank], ...]
        grouped by source, current stream; `splits` [cp][cp] the same on every rank."""
        ...

    def barrier(self) -> None: ...


def check_cp_size(cp_size: object, *, who: str) -> int:
    """`cp_size` as a positive int, else a ValueError naming the caller."""
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"{who}: cp_size must be a positive int, got {cp_size!r}")
    return cp_size


def check_input(x: Tensor, tag: str) -> Tensor:
    """The checks every backend runs on an all_gather input; returns x contiguous."""
    if not isinstance(tag, str) or not tag:
        raise ValueError(
            f"all_gather needs a non-empty str tag (e.g. 'layer3/kv_raw'), got {tag!r}"
        )
    if not isinstance(x, Tensor):
        raise TypeError(f"all_gather {tag!r}: expected a Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError(f"all_gather {tag!r}: x must have a row dim, got a 0-d tensor")
    return x.contiguous()


def check_splits(
    x: Tensor, splits: Sequence[Sequence[int]], rank: int, cp_size: int, tag: str
) -> tuple[list[list[int]], list[int], list[int]]:
    """An all_to_all's split matrix as ints [cp][cp], checked against this rank's x; returns
    (matrix, what this rank sends to each rank, what it receives from each rank)."""
    try:
        matrix = [[int(v) for v in row] for row in splits]
    except (TypeError, ValueError):
        raise ValueError(
            f"all_to_all {tag!r}: splits must be a [{cp_size}][{cp_size}] matrix of ints"
        ) from None
    if len(matrix) != cp_size or any(len(row) != cp_size for row in matrix):
        raise ValueError(
            f"all_to_all {tag!r}: splits must be [{cp_size}][{cp_size}], got "
            f"{[len(row) for row in matrix]} rows of lengths"
        )
    if any(v < 0 for row in matrix for v in row):
        raise ValueError(f"all_to_all {tag!r}: negative split in {matrix}")
    send = matrix[rank]
    recv = [matrix[i][rank] for i in range(cp_size)]
    if x.shape[0] != sum(send):
        raise ValueError(
            f"all_to_all {tag!r}: rank {rank} sends {sum(send)} rows (splits row {send}), "
            f"x has {x.shape[0]}"
        )
    return matrix, send, recv


def split_matrix(group: CPGroup, counts: Tensor, *, tag: str) -> list[list[int]]:
    """Every rank's send counts int64 [cp] (rows for each destination) → the [cp][cp] matrix
    `all_to_all` takes, the same on every rank: one all_gather and one host read (a sync)."""
    if counts.dim() != 1 or counts.shape[0] != group.cp_size:
        raise ValueError(
            f"split_matrix {tag!r}: counts must be [{group.cp_size}], got {tuple(counts.shape)}"
        )
    if group.cp_size == 1:
        return [[int(counts[0])]]
    rows = group.all_gather(counts.to(torch.int64).view(1, -1), tag=tag)
    return [[int(v) for v in row] for row in rows.cpu().tolist()]


def check_timeout(timeout_s: float) -> float:
    t = float(timeout_s)
    if not t > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    return t


def stays_rank_major(group: CPGroup, layout: CPLayout) -> bool:
    """Whether `gather_rows` leaves the all-gather in rank-major order: CP > 1 with no padding
    row (T == cp·P), so every gathered row is a token a row-wise consumer can take as it is."""
    return group.cp_size > 1 and layout.is_dense


def gather_rows(group: CPGroup, layout: CPLayout, x: Tensor, *, tag: str) -> Tensor:
    """`gather_global` for a consumer that takes the rows in any order (a store by destination
    row): the all-gather's rank-major rows [cp·P, ...] as they come when `stays_rank_major`
    (no rerange copy; `CPLayout.rank_major` puts token-order metadata in the same order), else
    `gather_global`'s token order."""
    if not stays_rank_major(group, layout):
        return gather_global(group, layout, x, tag=tag)
    if x.dim() == 0 or x.shape[0] != layout.padded_rows:
        raise ValueError(
            f"gather_rows {tag!r}: expected P={layout.padded_rows} rows, got {tuple(x.shape)}"
        )
    return group.all_gather(x, tag=tag)


def _padded(layout: CPLayout, x: Tensor, who: str, tag: str) -> Tensor:
    """x [≤ P, ...] with zero rows appended up to P."""
    p = layout.padded_rows
    if x.dim() == 0 or x.shape[0] > p:
        raise ValueError(f"{who} {tag!r}: expected at most P={p} rows, got {tuple(x.shape)}")
    if x.shape[0] < p:
        x = torch.cat([x, x.new_zeros((p - x.shape[0], *x.shape[1:]))])
    return x


def gather_global(group: CPGroup, layout: CPLayout, x: Tensor, *, tag: str) -> Tensor:
    """Local rows x [P, ...] (or fewer: padded here) → global rows [T, ...] in token order:
    the all-gather plus the rerange. cp_size 1 returns a view of x's first T rows."""
    x = _padded(layout, x, "gather_global", tag)
    if group.cp_size == 1:
        return x[: layout.num_tokens]
    return layout.unshard(group.all_gather(x, tag=tag))


def gather_indexed(
    group: CPGroup, layout: CPLayout, x: Tensor, *, tag: str
) -> tuple[Tensor, Tensor | None]:
    """`gather_global` for a consumer that reads its rows through an index: (the all-gather's
    rank-major rows [cp·P, ...] as they come, `layout.rerange_index`: token t's row), so no
    rerange copy; cp_size 1: (x's first T rows, None), already in token order. The same
    collective as `gather_global`'s."""
    x = _padded(layout, x, "gather_indexed", tag)
    if group.cp_size == 1:
        return x[: layout.num_tokens], None
    idx = layout.rerange_index
    return group.all_gather(x, tag=tag), idx if idx.device == x.device else idx.to(x.device)


class SingleCPGroup:
    """cp_size 1: all_gather returns its input (no copy)."""

    cp_size = 1
    rank = 0
    capturable = True  # no collective at all

    def all_gather(self, x: Tensor, *, tag: str) -> Tensor:
        return check_input(x, tag)

    def all_to_all(self, x: Tensor, splits: Sequence[Sequence[int]], *, tag: str) -> Tensor:
        x = check_input(x, tag)
        check_splits(x, splits, 0, 1, tag)
        return x

    def barrier(self) -> None:
        return None

    def __repr__(self) -> str:
        return "SingleCPGroup()"
