"""Interleave split of a flattened prefill batch across CP ranks (pure metadata).

Global token t (of the concatenation of every request's new tokens) lives on rank t % cp at
local row t // cp. Every rank holds the same number of physical rows P (the max logical count
rounded up to `align`), so an all-gather of the local rows has the fixed shape [cp·P, ...] in
rank-major order, and `rerange_index[t] = (t % cp)·P + t // cp` puts it back in token order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["CPLayout"]


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class CPLayout:
    """Where every global token lives under the interleave split.

    `logical_rows[r]` = real tokens of rank r (⌊T/cp⌋ + (r < T mod cp)); `padded_rows` = P, the
    physical rows of every rank (≥ 1, a multiple of `align`). When T < cp some ranks hold only
    padding. Index tensors live on `device`; `to(device)` makes a copy elsewhere.
    """

    num_tokens: int
    cp_size: int
    align: int
    padded_rows: int
    logical_rows: tuple[int, ...]
    rerange_index: Tensor = field(repr=False, compare=False)
    device: torch.device = field(default=torch.device("cpu"), compare=False)

    @classmethod
    def build(
        cls,
        num_tokens: int,
        cp_size: int,
        align: int = 1,
        *,
        device: torch.device | str | None = None,
    ) -> CPLayout:
        cp = _check_int("cp_size (the CP world size)", cp_size, 1)
        t = _check_int("num_tokens (total new tokens of the batch)", num_tokens, 1)
        a = _check_int("align (physical row multiple)", align, 1)
        logical = tuple(t // cp + (1 if r < t % cp else 0) for r in range(cp))
        padded = -(-logical[0] // a) * a  # rank 0 always holds the most rows
        dev = torch.device(device) if device is not None else torch.device("cpu")
        tok = torch.arange(t, device=dev, dtype=torch.long)
        rerange = (tok % cp) * padded + tok // cp
        return cls(t, cp, a, padded, logical, rerange, dev)

    # --- sizes -----------------------------------------------------------------------------
    @property
    def gathered_rows(self) -> int:
        """Rows of the rank-major all-gather output: cp·P."""
        return self.cp_size * self.padded_rows

    @property
    def is_dense(self) -> bool:
        """True when no rank has padding (T == cp·P): unshard is a view/transpose."""
        return self.num_tokens == self.gathered_rows

    def pad_rows(self, rank: int) -> int:
        return self.padded_rows - self.logical_rows[self._rank(rank)]

    def to(self, device: torch.device | str) -> CPLayout:
        dev = torch.device(device)
        if dev == self.device:
            return self
        return CPLayout(
            self.num_tokens,
            self.cp_size,
            self.align,
            self.padded_rows,
            self.logical_rows,
            self.rerange_index.to(dev),
            dev,
        )

    # --- per-rank metadata -----------------------------------------------------------------
    def local_token_ids(self, rank: int) -> Tensor:
        """Global token id of each local row of `rank`, -1 for padding rows. LongTensor [P]."""
        return self.shard_index(rank, pad_index=-1)

    def local_mask(self, rank: int) -> Tensor:
        """True for the real (non-padding) local rows of `rank`. BoolTensor [P]."""
        r = self._rank(rank)
        return torch.arange(self.padded_rows, device=self.device) < self.logical_rows[r]

    def shard_index(self, rank: int, pad_index: int = 0) -> Tensor:
        """Row of the global [T, ...] tensor each local row of `rank` reads; padding rows read
        `pad_index` (e.g. 0 to gather metadata rows, or a dummy row the caller appended)."""
        r = self._rank(rank)
        idx = torch.arange(self.padded_rows, device=self.device, dtype=torch.long)
        ids = idx * self.cp_size + r
        return torch.where(idx < self.logical_rows[r], ids, torch.full_like(ids, pad_index))

    def gathered_token_ids(self) -> Tensor:
        """Global token id of each row of the rank-major gather [cp·P], -1 for padding."""
        return torch.cat([self.local_token_ids(r) for r in range(self.cp_size)])

    # --- data movement ---------------------------------------------------------------------
    def shard(self, x: Tensor, rank: int, pad_value: float | int | bool = 0) -> Tensor:
        """Local rows of `rank` from global rows x [T, ...] → contiguous [P, ...].

        Padding rows are filled with `pad_value`. May share storage with x when cp_size == 1
        and there is no padding (never written to by this class)."""
        r = self._rank(rank)
        self._check_rows("shard", x, self.num_tokens, "T (num_tokens)")
        rows = x[r :: self.cp_size]
        n = self.logical_rows[r]
        if n == self.padded_rows:
            return rows.contiguous()
        out = x.new_full((self.padded_rows, *x.shape[1:]), pad_value)
        out[:n] = rows
        return out

    def rank_major(self, x: Tensor, pad_value: float | int | bool = 0) -> Tensor:
        """What an all-gather of every rank's `shard(x, r)` returns: [cp·P, ...]. Dense (no
        padding rows): one transposing copy, `unshard`'s inverse; else a shard per rank."""
        if self.is_dense and self.cp_size > 1:
            self._check_rows("rank_major", x, self.num_tokens, "T (num_tokens)")
            tail = x.shape[1:]
            g = x.reshape(self.padded_rows, self.cp_size, *tail).transpose(0, 1)
            return g.reshape(self.gathered_rows, *tail)
        return torch.cat([self.shard(x, r, pad_value) for r in range(self.cp_size)])

    def unshard(self, gathered: Tensor) -> Tensor:
        """Rank-major all-gather output [cp·P, ...] → global token order [T, ...].

        cp_size 1: a view of `gathered` (its first T rows). T == cp·P: view → transpose →
        reshape (one copy). Otherwise one index_select with `rerange_index`."""
        self._check_rows("unshard", gathered, self.gathered_rows, "cp·P (gathered_rows)")
        if self.cp_size == 1:
            return gathered[: self.num_tokens]
        if self.is_dense:
            tail = gathered.shape[1:]
            g = gathered.reshape(self.cp_size, self.padded_rows, *tail)
            return g.transpose(0, 1).reshape(self.num_tokens, *tail)
        idx = self.rerange_index
        if idx.device != gathered.device:
            idx = idx.to(gathered.device)
        return gathered.index_select(0, idx)

    # --- validation ------------------------------------------------------------------------
    def _rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"rank must be an int, got {type(rank).__name__}")
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank {rank} out of range for cp_size {self.cp_size}")
        return rank

    @staticmethod
    def _check_rows(what: str, x: Tensor, rows: int, name: str) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"CPLayout.{what}: expected a Tensor, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[0] != rows:
            raise ValueError(
                f"CPLayout.{what}: expected {rows} rows on dim 0 ({name}), "
                f"got shape {tuple(x.shape)}"
            )
