"""Per-forward state of one CP rank: the batch's inputs, and what later layers read.

Inputs: the caches (replicated on every rank), the batch metadata (global rows, `meta.tokens`),
this rank's local rows (`local`, and `local_ids`: the global token of each local row, -1 for
padding), the CP group and the CP layout. "Reads are local, writes are global": queries use
`local`, cache writes use the gathered global rows.

`cross` is the one thing layers write for later layers: per compress ratio the top-k of the
latest index source and the candidate blocks of the candidate source, and `attention`, what the
layers' sparse attention computes alike (window rows, the top-k's compressed rows, the kernels'
workspace). (Index keys are read from the kv source's index cache, not passed along.) A context
lives for one forward: the runner, the SGLang engine and every graph capture build a new one.
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
class AttentionMemo:
    """What the attention layers of one forward compute alike, kept for the next layer: the SWA
    rows the batch's keys are stored at and the window's SWA rows (the same for every layer), the
    compressed rows of the latest top-k (the same for every layer that reads that top-k through
    that kv source), per ratio the cache rows of the batch's compressed entries, and the kernels'
    last sparse-attention workspace (`ops.workspace_rows.WorkspaceMemo`, FlashMLA's bf16 rows and
    remapped indices: a later call with the same index tensors, or the same entry rows, decodes
    only its own SWA rows into it). A layer that publishes a top-k computes its compressed rows
    afresh; one that writes a compressed cache (a kv source) also its workspace."""

    window: Tensor | None = None  # [L, W] int32 SWA cache rows, −1 none
    store_rows: Tensor | None = None  # [T] int64 SWA rows of the gathered keys, gather order
    comp_key: tuple[int, int, int] | None = None  # (ratio, kv source, top-k layer) of `comp`
    comp: Tensor | None = None  # [L, K] int32 compressed cache rows, −1 none
    workspace: object | None = None  # the sparse-attention kernel's memo
    # per ratio: int32 [N] compressed cache rows of the batch's entries (the workspace's list)
    entry_rows: dict[int, Tensor] = field(default_factory=dict)


@dataclass
class CrossLayer:
    """Per compress ratio: what one layer of a forward leaves for the later ones."""

    topk: dict[int, Tensor] = field(default_factory=dict)  # written by each index source
    candidates: dict[int, Tensor] = field(default_factory=dict)  # by the candidate source
    attention: AttentionMemo = field(default_factory=AttentionMemo)


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
