"""What the model sees of context parallelism: the `CPGroup` protocol, its errors, the input
checks every backend shares, `SingleCPGroup`, and `gather_global`, the one gather.

`all_gather(x [P, ...], tag=...)` returns [cp·P, ...] rank-major and is issued on the CURRENT
stream (never on a side stream: docs/invariants.md, invariant 1). Every rank must pass the same
shape; the caller pads with `CPLayout.shard`. `tag` names the tensor ("layer3/kv_raw") for the
order guard and for error messages.

Backends: `SingleCPGroup` (cp_size 1, here), `TorchDistCPGroup` (`cp/dist.py`: NCCL on GPU, gloo
on CPU) and `FakeCPWorld` / `FakeCPGroup` (`cp/fake.py`: every rank a thread of one process).
"""

from __future__ import annotations

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
    "check_timeout",
    "gather_global",
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
    """

    capturable: bool

    @property
    def cp_size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    def all_gather(self, x: Tensor, *, tag: str) -> Tensor:
        """x [P, ...] (same shape on every rank) → [cp·P, ...] rank-major, current stream."""
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


def check_timeout(timeout_s: float) -> float:
    t = float(timeout_s)
    if not t > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    return t


def gather_global(group: CPGroup, layout: CPLayout, x: Tensor, *, tag: str) -> Tensor:
    """Local rows x [P, ...] (or fewer: padded here) → global rows [T, ...] in token order:
    the all-gather plus the rerange. cp_size 1 returns a view of x's first T rows."""
    p = layout.padded_rows
    if x.dim() == 0 or x.shape[0] > p:
        raise ValueError(
            f"gather_global {tag!r}: expected at most P={p} rows, got {tuple(x.shape)}"
        )
    if x.shape[0] < p:
        pad = x.new_zeros((p - x.shape[0], *x.shape[1:]))
        x = torch.cat([x, pad])
    if group.cp_size == 1:
        return x[: layout.num_tokens]
    return layout.unshard(group.all_gather(x, tag=tag))


class SingleCPGroup:
    """cp_size 1: all_gather returns its input (no copy)."""

    cp_size = 1
    rank = 0
    capturable = True  # no collective at all

    def all_gather(self, x: Tensor, *, tag: str) -> Tensor:
        return check_input(x, tag)

    def barrier(self) -> None:
        return None

    def __repr__(self) -> str:
        return "SingleCPGroup()"
