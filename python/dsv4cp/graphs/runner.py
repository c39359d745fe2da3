"""Prefill forwards captured per token bucket as breakable CUDA graphs, replayed per batch.

Each bucket (a global token count) owns static inputs — token ids and every `TokenMeta` field
at the bucket's capacity, the compressed workspaces at their capacity, the CP layout of the
bucket — and a `BreakableGraph` of the whole forward (embedding → every layer, indexer and
compressor included → gather of the last hidden rows). Before a replay the live batch is copied
into the static buffers in place: live rows first, padding rows invalid (dummy slot 0, position
0); live lengths only feed metadata, capacities fix the shapes (docs/invariants.md, invariant 5).
Batches larger than the largest bucket or outside the context bounds run eagerly (logged).

The graph runner alone decides eager breaks: a CP group that is not `capturable` is wrapped in
an `EagerBreakCPGroup` (each gather a break), and the layers then run their gathers-first
schedule (`overlap_gathers`), since a break may not sit inside an open fork.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dsv4cp.batch import PAD_ROW, BatchMetadata, CompressedWorkspace, TokenMeta
from dsv4cp.config_fields import is_int
from dsv4cp.cp.group import CPGroup
from dsv4cp.cp.layout import CPLayout
from dsv4cp.graphs.bcg import BreakableGraph, eager_break
from dsv4cp.side_streams import side_stream

log = logging.getLogger("dsv4cp.graphs")


@dataclass(frozen=True)
class GraphConfig:
    buckets: tuple[int, ...] = (64, 256, 1024)  # global tokens per forward
    max_requests: int = 8
    max_context: int = 2048  # bound on one request's prefix + new tokens (logits width)
    max_batch_context: int = 0  # bound on Σ (prefix + new) over the batch; 0 = 2·max_context

    def __post_init__(self) -> None:
        """Every field an int (not a bool) in range: a ValueError naming the field. A negative
        max_batch_context once gave a workspace too small for any batch (graphs never used)."""
        buckets = tuple(self.buckets) if isinstance(self.buckets, (tuple, list)) else None
        if not buckets or not all(is_int(b) and b >= 1 for b in buckets):
            raise ValueError(
                f"GraphConfig.buckets must be a non-empty sequence of positive ints, got "
                f"{self.buckets!r}"
            )
        for name, low in (("max_requests", 1), ("max_context", 1), ("max_batch_context", 0)):
            v = getattr(self, name)
            if not is_int(v) or v < low:
                what = "0 (= 2·max_context) or a positive int" if low == 0 else "a positive int"
                raise ValueError(f"GraphConfig.{name} must be {what}, got {v!r}")

    @property
    def batch_context(self) -> int:
        return self.max_batch_context or 2 * self.max_context


@dataclass
class BucketReport:
    tokens: int
    capture_s: float
    pool_bytes: int
    segments: int


class StaticBatch:
    """Capture-stable metadata of one bucket; `refresh` copies a live batch in place."""

    def __init__(
        self,
        bucket: int,
        cfg: GraphConfig,
        req_to_token: Tensor,
        ratios: list[int],
        cp: CPGroup,
    ) -> None:
        dev = req_to_token.device
        self.bucket = bucket
        self.ids = torch.zeros(bucket, dtype=torch.long, device=dev)
        self.tokens = TokenMeta(
            **{
                n: torch.full((bucket,), v, dtype=torch.long, device=dev)
                for n, v in PAD_ROW.items()
            },
            valid=torch.zeros(bucket, dtype=torch.bool, device=dev),
            req_to_token=req_to_token,
        )
        self.workspaces = {
            r: CompressedWorkspace(
                ratio=r,
                slots=torch.zeros(
                    cfg.batch_context // r + cfg.max_requests, dtype=torch.long, device=dev
                ),
                request_offset=torch.zeros(cfg.max_requests, dtype=torch.long, device=dev),
                max_entries=cfg.max_context // r,
            )
            for r in ratios
        }
        self.meta = BatchMetadata(batch=None, tokens=self.tokens, workspaces=self.workspaces)
        self.layout = CPLayout.build(bucket, cp.cp_size).to(dev)
        self.local_ids = self.layout.local_token_ids(cp.rank)

    def fits(self, meta: BatchMetadata) -> str | None:
        """None if the live batch fits this bucket's capacities, else why not."""
        if meta.tokens.num_rows > self.bucket:
            return f"{meta.tokens.num_rows} tokens > bucket {self.bucket}"
        for r, ws in meta.workspaces.items():
            cap = self.workspaces[r]
            if ws.slots.numel() > cap.slots.numel():
                return f"ratio {r}: {ws.slots.numel()} compressed entries > {cap.slots.numel()}"
            if ws.max_entries > cap.max_entries:
                return f"ratio {r}: context {ws.max_entries} entries > bound {cap.max_entries}"
            if ws.request_offset.numel() > cap.request_offset.numel():
                return f"{ws.request_offset.numel()} requests > {cap.request_offset.numel()}"
        return None

    def refresh(self, meta: BatchMetadata, input_ids: Tensor) -> None:
        n = meta.tokens.num_rows
        live, st = meta.tokens, self.tokens
        for name, pad in PAD_ROW.items():
            dst = getattr(st, name)
            dst[:n].copy_(getattr(live, name))
            dst[n:].fill_(pad)
        st.valid[:n].copy_(live.valid)
        st.valid[n:].fill_(False)
        self.ids[:n].copy_(input_ids)
        self.ids[n:].fill_(0)
        for r, ws in meta.workspaces.items():
            cap = self.workspaces[r]
            m, k = ws.slots.numel(), ws.request_offset.numel()
            cap.slots[:m].copy_(ws.slots)
            cap.slots[m:].fill_(0)
            cap.request_offset[:k].copy_(ws.request_offset)
            cap.request_offset[k:].fill_(0)


class EagerBreakCPGroup:
    """A CP group that is not capturable, as a captured forward sees it: every all_gather is an
    eager break (run outside the graph, at capture and at every replay). Outside a capture it is
    the wrapped group."""

    capturable = False

    def __init__(self, inner: CPGroup) -> None:
        self.inner = inner

    @property
    def cp_size(self) -> int:
        return self.inner.cp_size

    @property
    def rank(self) -> int:
        return self.inner.rank

    def all_gather(self, x: Tensor, *, tag: str) -> Tensor:
        return eager_break(self._gather, x, tag)

    def _gather(self, x: Tensor, tag: str) -> Tensor:
        return self.inner.all_gather(x, tag=tag)

    def all_to_all(self, x: Tensor, splits: Sequence[Sequence[int]], *, tag: str) -> Tensor:
        """An eager break too; its output shape is fixed at capture, so only splits that do not
        change between capture and replay are valid (the MoE refuses EP under capture)."""
        return eager_break(self._all_to_all, x, splits, tag)

    def _all_to_all(self, x: Tensor, splits: Sequence[Sequence[int]], tag: str) -> Tensor:
        return self.inner.all_to_all(x, splits, tag=tag)

    def barrier(self) -> None:
        self.inner.barrier()

    def __repr__(self) -> str:
        return f"EagerBreakCPGroup({self.inner!r})"


@dataclass
class BucketGraph:
    static: StaticBatch
    graph: BreakableGraph
    report: BucketReport


class GraphRunner:
    """Captures `body(static) -> hidden [bucket, d]` for every bucket, largest first.

    `cp` is the group captured forwards gather through, and `overlap_gathers` whether their
    layers may overlap the gathers with forked lanes: both follow from `capturable`, here only.
    """

    def __init__(self, config: GraphConfig, cp: CPGroup) -> None:
        self.config = config
        self.overlap_gathers = cp.capturable
        self.cp: CPGroup = cp if cp.capturable else EagerBreakCPGroup(cp)
        self.graphs: dict[int, BucketGraph] = {}
        self.capture_stream: torch.cuda.Stream | None = None
        self.fallbacks = 0
        self._logged: set[str] = set()

    def capture(
        self,
        body: Callable[[StaticBatch], Tensor],
        make_static: Callable[[int], StaticBatch],
        barrier: Callable[[], None],
    ) -> list[BucketReport]:
        pool = None
        # One capture stream for every bucket of this runner, held by no other rank or graph.
        self.capture_stream = side_stream(owner=self)
        for bucket in sorted(set(self.config.buckets), reverse=True):
            static = make_static(bucket)
            barrier()
            torch.cuda.synchronize()
            before = torch.cuda.memory_reserved()
            t0 = time.perf_counter()
            body(static)  # warm-up: allocator, cuBLAS workspaces, lazy state (all rows padding)
            torch.cuda.synchronize()
            # No rank may synchronise the device while another (a FakeCPGroup thread sharing the
            # GPU) is capturing: barriers fence the capture on both sides.
            barrier()
            graph = BreakableGraph(pool=pool, stream=self.capture_stream)
            graph.capture(functools.partial(body, static))
            barrier()
            torch.cuda.synchronize()
            pool = graph.pool
            rep = BucketReport(
                bucket,
                time.perf_counter() - t0,
                torch.cuda.memory_reserved() - before,
                graph.num_segments,
            )
            log.info(
                "captured bucket %d tokens: %.2f s, %.1f MiB, %d segment(s)",
                bucket,
                rep.capture_s,
                rep.pool_bytes / 2**20,
                rep.segments,
            )
            self.graphs[bucket] = BucketGraph(static, graph, rep)
        return self.reports()

    def reports(self) -> list[BucketReport]:
        return [self.graphs[b].report for b in sorted(self.graphs)]

    def select(self, meta: BatchMetadata) -> BucketGraph | None:
        reasons = []
        for bucket in sorted(self.graphs):
            why = self.graphs[bucket].static.fits(meta)
            if why is None:
                return self.graphs[bucket]
            reasons.append(why)
        self.fallbacks += 1
        why = reasons[-1] if reasons else "no graphs captured"
        if why not in self._logged:
            self._logged.add(why)
            log.warning("eager fallback (graphs do not fit): %s", why)
        return None

    def replay(self, bg: BucketGraph, meta: BatchMetadata, input_ids: Tensor) -> Tensor:
        # The static buffers were made under inference mode (capture); refreshing them in place
        # needs it too, whatever mode the caller runs in (SGLang's loop does; a bare call not).
        with torch.inference_mode():
            bg.static.refresh(meta, input_ids)
            hidden = bg.graph.replay()
            return hidden[: meta.tokens.num_rows].clone()
