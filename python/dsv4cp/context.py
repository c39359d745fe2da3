"""Per-forward state shared by the layers of one prefill forward on one CP rank."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from dsv4cp.batch import BatchMetadata, TokenMeta
from dsv4cp.bcg import eager_break
from dsv4cp.cache import KVCache
from dsv4cp.cp.comm import CPGroup
from dsv4cp.cp.layout import CPLayout
from dsv4cp.policy import MultistreamPolicy
from dsv4cp.roles import LayerRole
from dsv4cp.timing import StageTimer


@dataclass
class ForwardContext:
    """Reads are local (`local`: this rank's rows), writes are global (`meta.tokens`).

    Cross-layer results live here, per compress ratio: the index-K workspace built by the kv
    source, the top-k of the latest index source, and the candidate blocks of the candidate
    source. The caches are replicated on every rank.
    """

    cache: KVCache
    meta: BatchMetadata
    local: TokenMeta
    cp: CPGroup
    layout: CPLayout
    multistream: bool = False
    streams: object | None = None  # schedule.StreamPool when multistream
    logits_budget_bytes: int = 256 << 20
    index_k_ws: dict[int, Tensor] = field(default_factory=dict)
    topk: dict[int, Tensor] = field(default_factory=dict)
    candidates: dict[int, Tensor] = field(default_factory=dict)
    record: dict[str, Tensor] | None = None  # per-layer outputs kept for `dsv4cp check`
    lane_hook: object | None = None  # test hook: callable(lane) run at the start of each lane
    timer: StageTimer | None = None  # per-stage wall time (serial executor only: it syncs)
    policy: MultistreamPolicy | None = None  # per-layer say when multistream is on
    overlap_gathers: bool = True  # False: gathers are graph breaks, fork the Q lanes after them

    def gather(self, x: Tensor, tag: str) -> Tensor:
        """Local rows [P, ...] → global rows [T, ...] in token order (all-gather + rerange)."""
        if self.cp.cp_size == 1:
            return x[: self.layout.num_tokens]
        if not getattr(self.cp, "capturable", False):
            # Not capturable (FakeCPGroup threads): an eager break under graphs, a call otherwise.
            return eager_break(self._gather_now, x, tag)
        return self._gather_now(x, tag)

    def _gather_now(self, x: Tensor, tag: str) -> Tensor:
        return self.layout.unshard(self.cp.all_gather(x.contiguous(), tag=tag))

    def policy_allows(self, role: LayerRole) -> bool:
        return self.policy is None or self.policy.layer_pays(role)

    def workspace_start(self, ratio: int) -> Tensor:
        return self.meta.workspace_start(ratio, self.local)

    @property
    def device(self) -> torch.device:
        return self.cache.device
