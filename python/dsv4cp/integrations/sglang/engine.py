"""The adapter's forward, without sglang: caches on SGLang's token slots, executors, graphs.

`ServingEngine` owns what `model.DeepseekV41ForCausalLM` runs per forward, so that it runs (and
is tested on the GPU) with a stand-in ForwardBatch and no sglang installed:

- the cache: dsv4cp's `KVCache` in the model's numerics (`quant="qat"`: fp8 SWA rows, fp4
  compressed and index keys, docs/caches.md), one row per SGLang token slot (SGLang's allocator,
  radix cache and `req_to_token` decide which slots a request holds; windowed SWA pages would
  need to follow that allocator, which frees nothing per window), and `token_ids` at each slot
  (Engram's n-gram history: written by the model's forward from the batch's ids at
  `out_cache_loc`, read back through `req_to_token`, radix-shared prefixes included);
- the executors: `ExecutorFactory.choose` per forward (multistream policy, CUDA only);
- graphs (CUDA, opt-in): `GraphRunner` buckets captured at the first forward that runs with a
  given CP group (every rank sees the same batch, so every rank captures together), replayed
  for the batches that fit a bucket; the rest run eagerly. A model with Engram layers runs
  eagerly (its tables are host memmaps a graph cannot capture).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor

from dsv4cp.batch import build_metadata
from dsv4cp.cache import KVCache
from dsv4cp.context import ForwardContext
from dsv4cp.cp.group import CPGroup
from dsv4cp.executors import ExecutorFactory
from dsv4cp.graphs.runner import GraphConfig, GraphRunner, StaticBatch
from dsv4cp.integrations.sglang.forward_batch import SGLangBatch, sync_req_to_token
from dsv4cp.model import DeepseekV41Model
from dsv4cp.policy import MultistreamPolicy

logger = logging.getLogger(__name__)

__all__ = ["ServingEngine"]


class ServingEngine:
    def __init__(
        self,
        model: DeepseekV41Model,
        *,
        multistream: bool | str | MultistreamPolicy | None = None,
        graphs: GraphConfig | None = None,
        capture_barrier: Callable[[], None] | None = None,
    ) -> None:
        """`capture_barrier` fences every graph capture across the ranks that share a device
        (FakeCPGroup threads; default: the barrier of the group being captured)."""
        self.model = model
        self.capture_barrier = capture_barrier
        self.ratios = sorted({r for r in model.config.layer_ratios if r})
        self.executors = ExecutorFactory.create(
            MultistreamPolicy.from_env() if multistream is None else multistream,
            device=model.device,
            lanes=model.prepare_lanes(),
        )
        if graphs is not None:
            if model.device.type != "cuda":
                raise ValueError("dsv4cp: graphs need a CUDA device")
            if model.engram_layers:
                logger.warning(
                    "dsv4cp: the model has Engram layers (host table lookups): graphs off, "
                    "every forward runs eagerly"
                )
                graphs = None
        self.graph_config = graphs
        self.graph_runners: dict[int, GraphRunner] = {}  # by CP size
        self.cache: KVCache | None = None

    # ------------------------------------------------------------------ cache
    def new_cache(self, num_slots: int, page_size: int, table_shape: tuple[int, int]) -> KVCache:
        m = self.model
        rows, width = table_shape
        return KVCache(
            m.config,
            num_slots,
            quant=m.quant,
            max_requests=rows,
            max_context=width,
            page_size=page_size,
            device=m.device,
            dtype=m.dtype,
        )

    def cache_for(self, num_slots: int, page_size: int, req_to_token: Tensor) -> KVCache:
        """The cache for SGLang's pools: `num_slots` token slots (slot 0 the dummy), a position
        → slot table shaped like SGLang's `req_to_token` (dsv4cp's own int64 copy)."""
        shape = (int(req_to_token.shape[0]), int(req_to_token.shape[1]))
        cache = self.cache
        if cache is not None and cache.num_slots >= num_slots and cache.req_to_token.shape == shape:
            return cache
        if self.graph_runners:
            raise ValueError(
                "dsv4cp: SGLang's token pools changed after graphs were captured "
                f"({cache.num_slots if cache else 0} slots → {num_slots}, table {shape})"
            )
        if cache is not None and cache.num_slots >= num_slots:
            table = torch.zeros(shape, dtype=torch.long, device=cache.device)
            cache.req_to_token = table
            cache.max_requests, cache.max_context = shape
        else:
            if cache is not None:
                logger.warning(
                    "dsv4cp: SGLang's pool holds %d slots, more than the %d allocated; "
                    "reallocating",
                    num_slots,
                    cache.num_slots,
                )
            cache = self.cache = self.new_cache(num_slots, page_size, shape)
        by_kind = cache.nbytes_by_kind()
        logger.info(
            "dsv4cp: KV cache of %d slots (%s numerics), %d request rows x %d positions: "
            "%.1f MiB, %.0f B/slot",
            cache.num_slots,
            cache.quant,
            *shape,
            sum(by_kind.values()) / 2**20,
            sum(by_kind.values()) / cache.num_slots,
        )
        return cache

    # ------------------------------------------------------------------ forward
    def forward(
        self, batch: SGLangBatch, req_to_token: Tensor, cp: CPGroup, *, num_slots: int, page: int
    ) -> Tensor:
        """Global hidden rows [T, d] (before the final norm) of one SGLang forward."""
        cache = self.cache_for(num_slots, page, req_to_token)
        sync_req_to_token(cache.req_to_token, req_to_token, batch)
        meta = build_metadata(
            batch.prefill_batch(), cache.req_to_token, batch.slots.to(cache.device), self.ratios
        )
        input_ids = batch.input_ids.to(cache.device)
        gr = self._graph_runner(cache, cp)
        if gr is not None:
            bg = gr.select(meta)
            if bg is not None:
                return gr.replay(bg, meta, input_ids)
        ctx = ForwardContext.for_rank(meta, cache, cp)
        executors = self.executors.choose(ctx.local_rows, graphs=False)
        return self.model.forward(input_ids, ctx, executors)

    def _graph_runner(self, cache: KVCache, cp: CPGroup) -> GraphRunner | None:
        cfg = self.graph_config
        if cfg is None or self.model.hooked:
            return None
        gr = self.graph_runners.get(cp.cp_size)
        if gr is None:
            gr = self.graph_runners[cp.cp_size] = GraphRunner(cfg, cp)

            def body(static: StaticBatch) -> Tensor:
                ctx = ForwardContext.for_rank(
                    static.meta, cache, gr.cp, layout=static.layout, local_ids=static.local_ids
                )
                executors = self.executors.choose(
                    ctx.local_rows, graphs=True, overlap_gathers=gr.overlap_gathers
                )
                return self.model.forward(static.ids, ctx, executors)

            with torch.inference_mode():
                gr.capture(
                    body,
                    lambda b: StaticBatch(b, cfg, cache.req_to_token, self.ratios, cp),
                    self.capture_barrier or cp.barrier,
                )
        return gr
