"""Per-forward state of one CP rank: the batch's inputs, and what later layers read.

Inputs: the caches (replicated on every rank), the batch metadata (global rows, `meta.tokens`),
this rank's local rows (`local`, and `local_ids`: the global token of each local row, -1 for
padding), the CP group and the CP layout. "Reads are local, writes are global": queries use
`local`, cache writes use the gathered global rows.

`cross` is the one thing layers write for later layers, per compress ratio: the top-k of the
latest index source and the candidate blocks of the candidate source. (Index keys are read from
the kv source's index cache, not passed along.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from dsv4cp.batch import BatchMetadata, TokenMeta
from dsv4cp.cache import KVCache
from dsv4cp.cp.group import CPGroup
from dsv4cp.cp.layout import CPLayout


@dataclass
class CrossLayer:
    """Per compress ratio: what one layer of a forward leaves for the later ones."""

    topk: dict[int, Tensor] = field(default_factory=dict)  # written by each index source
    candidates: dict[int, Tensor] = field(default_factory=dict)  # by the candidate source


@dataclass
class ForwardContext:
    cache: KVCache
    meta: BatchMetadata
    local: TokenMeta
    local_ids: Tensor
    cp: CPGroup
    layout: CPLayout
    cross: CrossLayer = field(default_factory=CrossLayer)

    @classmethod
    def for_rank(
        cls,
        meta: BatchMetadata,
        cache: KVCache,
        cp: CPGroup,
        *,
        layout: CPLayout | None = None,
        local_ids: Tensor | None = None,
    ) -> ForwardContext:
        """This rank's view of a batch. A graph bucket passes its static `layout` and
        `local_ids`; otherwise they are built from the batch's token count."""
        if layout is None:
            layout = CPLayout.build(meta.tokens.num_rows, cp.cp_size).to(cache.device)
        if local_ids is None:
            local_ids = layout.local_token_ids(cp.rank)
        local = meta.tokens.take(local_ids)
        return cls(cache=cache, meta=meta, local=local, local_ids=local_ids, cp=cp, layout=layout)

    @property
    def local_rows(self) -> int:
        """Physical rows of every rank (P): what the multistream policy weighs."""
        return self.layout.padded_rows

    def workspace_start(self, ratio: int) -> Tensor:
        return self.meta.workspace_start(ratio, self.local)

    @property
    def device(self) -> torch.device:
        return self.cache.device
