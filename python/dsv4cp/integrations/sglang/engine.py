"""The adapter's forward, without sglang: caches on SGLang's token slots, executors, graphs.

`ServingEngine` owns what `model.DeepseekV41ForCausalLM` runs per forward, so that it runs (and
is tested on the GPU) with a stand-in ForwardBatch and no sglang installed:

- the cache: dsv4cp's `KVCache` in the model's numerics (`quant="qat"`: fp8 SWA rows, fp4
  compressed and index keys, docs/caches.md) on SGLang's token slots (SGLang's allocator, radix
  cache and `req_to_token` decide which slots a request holds). Compressed and index keys and
  `token_ids` (Engram's n-gram history: written by the model's forward from the batch's ids at
  `out_cache_loc`, read back through `req_to_token`, radix-shared prefixes included) have a row
  per token slot. SWA rows and the ratio-2 pair state: with SGLang's hybrid-SWA pools (`SWAPool`:
  its SWA allocator and SWA radix cache free the SWA slots of tokens outside the window) a row
  per SGLang SWA slot, found through SGLang's full → SWA slot map; without them
  (`--disable-hybrid-swa-memory`) a row per token slot. At an even page size the pair state
  has a row per even SWA slot only (`KVCache.pair_div`: SGLang's paged SWA allocator keeps
  swa_slot ≡ position mod page). Before each forward (`window_check_enabled`) the rows its
  windows read are checked to be held (`check_window_held`) and the SWA slots of the even
  positions it writes or reads in the pair state to be even (`check_pair_parity`);
- the executors: `ExecutorFactory.choose` per forward (multistream policy, CUDA only);
- graphs (CUDA, opt-in): `GraphRunner` buckets captured at the first forward that runs with a
  given CP group (every rank sees the same batch, so every rank captures together), replayed
  for the batches that fit a bucket; the rest run eagerly. A model with Engram layers runs
  eagerly (its tables are host memmaps a graph cannot capture).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dsv4cp import env_vars
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

__all__ = [
    "SWAPool",
    "ServingEngine",
    "check_pair_parity",
    "check_window_held",
    "window_check_enabled",
]

WINDOW_CHECK_ENV = "DSV4CP_CHECK_WINDOW"


@dataclass(frozen=True)
class SWAPool:
    """SGLang's hybrid-SWA pools as dsv4cp's cache uses them.

    `rows`: SWA rows dsv4cp's cache needs (SGLang's SWA slots are 1..size_swa, plus page
    padding; row 0 is the dummy); `mapping`: SGLang's `full_to_swa_index_mapping` (token slot →
    SWA slot, 0 when the slot holds none), kept by reference: SGLang updates it in place."""

    rows: int
    mapping: Tensor


def window_check_enabled(device: torch.device) -> bool:
    """Whether each forward runs `check_window_held` and `check_pair_parity`:
    DSV4CP_CHECK_WINDOW=1 / 0 forces them on / off; unset, on for CPU and off for CUDA (they
    build W − 1 positions per request on the host and wait for a device comparison: host time
    on every forward, not measured on a GPU server; the adapter already reads the batch's ids
    and positions on the host, so they add one more wait, not the first)."""
    forced: bool | None = env_vars.read(WINDOW_CHECK_ENV)
    return device.type != "cuda" if forced is None else forced


def check_window_held(cache: KVCache, batch: SGLangBatch, window: int) -> None:
    """Raise unless every cached position a request's new tokens read in their window (the
    `window − 1` positions before its first new token, the ratio-2 partner among them) still
    has its SWA row. SGLang's SWA radix cache matches only prefixes whose last window is held
    and frees a running request's rows only behind its window, so this never fires unless that
    contract breaks; it makes a break an error instead of a silently different output."""
    if cache.swa_slot_map is None or not batch.req_rows:
        return
    rows: list[int] = []
    positions: list[int] = []
    for row, start in zip(batch.req_rows, batch.starts):
        lo = max(0, start - window + 1)
        rows += [row] * (start - lo)
        positions += range(lo, start)
    if not rows:
        return
    r2t = cache.req_to_token
    r = torch.tensor(rows, dtype=torch.long, device=r2t.device)
    p = torch.tensor(positions, dtype=torch.long, device=r2t.device)
    held = cache.swa_rows(r2t[r, p]) > 0
    if not bool(held.all()):
        bad = int((~held).nonzero()[0, 0])
        raise RuntimeError(
            f"dsv4cp: request row {rows[bad]} reads position {positions[bad]} in its window "
            "but SGLang's hybrid-SWA allocator no longer holds its SWA slot (the window would "
            "read a freed row)"
        )


def check_pair_parity(cache: KVCache, batch: SGLangBatch) -> None:
    """Raise unless every even position whose pair row this forward writes (its new even
    tokens) or reads (the partner `start − 1` of an odd start) has an even SWA slot, when the
    cache halves the pair state (`pair_div` 2, an even page size). SGLang's paged SWA allocator
    hands a request page-aligned SWA slots in step with its positions (swa_slot ≡ position mod
    page), so this never fires unless that breaks; an odd slot would share its row with the
    even slot below it and another request's pair state could overwrite it."""
    if cache.pair_div == 1 or not batch.req_rows:
        return
    positions: list[int] = []
    for start, n in zip(batch.starts, batch.new_lens):
        positions += range(start, start + n)
    pos = torch.tensor(positions, dtype=torch.long, device=cache.device)
    slots = batch.slots.to(cache.device).long()
    reads = [(row, s - 1) for row, s, n in zip(batch.req_rows, batch.starts, batch.new_lens)]
    reads = [(row, p) for row, p in reads if p >= 0 and p % 2 == 0]
    if reads:
        r, p = (torch.tensor(v, dtype=torch.long, device=cache.device) for v in zip(*reads))
        pos = torch.cat([pos, p])
        slots = torch.cat([slots, cache.req_to_token[r, p]])
    swa = cache.swa_rows(slots)
    bad = (pos % 2 == 0) & (swa > 0) & (swa % 2 == 1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise RuntimeError(
            f"dsv4cp: even position {int(pos[i])} has the odd SWA slot {int(swa[i])} (page "
            f"size {cache.page_size}): the pair state, a row per even SWA slot, assumes "
            "SGLang's SWA slots keep the position's parity"
        )


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
    def new_cache(
        self,
        num_slots: int,
        page_size: int,
        table_shape: tuple[int, int],
        swa_rows: int | None = None,
    ) -> KVCache:
        """`swa_rows`: SWA and pair-state rows indexed by SGLang's SWA slots (hybrid-SWA pools);
        None: a row per token slot."""
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
            swa_slots=swa_rows,
        )

    def cache_for(
        self,
        num_slots: int,
        page_size: int,
        req_to_token: Tensor,
        swa: SWAPool | None = None,
    ) -> KVCache:
        """The cache for SGLang's pools: `num_slots` token slots (slot 0 the dummy), a position
        → slot table shaped like SGLang's `req_to_token` (dsv4cp's own int64 copy), SWA rows on
        SGLang's SWA slots when `swa` is given."""
        shape = (int(req_to_token.shape[0]), int(req_to_token.shape[1]))
        cache = self.cache
        # the page size fixes the cache's layout (entry rows slot // r, the pair rows' halving)
        fits = cache is not None and cache.num_slots >= num_slots and cache.page_size == page_size
        if cache is not None and (cache.swa_slots is None) != (swa is None):
            fits = False
        if cache is not None and swa is not None and (cache.swa_slots or 0) < swa.rows:
            fits = False
        if fits and cache is not None and cache.req_to_token.shape == shape:
            if swa is not None and cache.swa_slot_map is not swa.mapping:
                cache.set_swa_slot_map(swa.mapping)
            return cache
        if self.graph_runners:
            raise ValueError(
                "dsv4cp: SGLang's token pools changed after graphs were captured "
                f"({cache.num_slots if cache else 0} slots → {num_slots}, page size "
                f"{cache.page_size if cache else '-'} → {page_size}, table {shape})"
            )
        if cache is not None and fits:
            table = torch.zeros(shape, dtype=torch.long, device=cache.device)
            cache.req_to_token = table
            cache.max_requests, cache.max_context = shape
        else:
            if cache is not None:
                logger.warning(
                    "dsv4cp: SGLang's pools (%d slots, page size %d, SWA rows %s) do not fit "
                    "the cache allocated (%d slots, page size %d, SWA rows %s); reallocating",
                    num_slots,
                    page_size,
                    swa.rows if swa else "per slot",
                    cache.num_slots,
                    cache.page_size,
                    cache.swa_slots or "per slot",
                )
            cache = self.cache = self.new_cache(
                num_slots, page_size, shape, swa.rows if swa else None
            )
        if swa is not None:
            cache.set_swa_slot_map(swa.mapping)
        by_kind = cache.nbytes_by_kind()
        logger.info(
            "dsv4cp: KV cache of %d slots, SWA rows %s (%s numerics), %d request rows x %d "
            "positions: %.1f MiB, %.0f B/slot (%s)",
            cache.num_slots,
            cache.swa_slots or "per slot",
            cache.quant,
            *shape,
            sum(by_kind.values()) / 2**20,
            sum(by_kind.values()) / cache.num_slots,
            ", ".join(f"{k} {v / cache.num_slots:.0f}" for k, v in by_kind.items()),
        )
        return cache

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        batch: SGLangBatch,
        req_to_token: Tensor,
        cp: CPGroup,
        *,
        num_slots: int,
        page: int,
        swa: SWAPool | None = None,
    ) -> Tensor:
        """Global hidden rows [T, d] (before the final norm) of one SGLang forward."""
        cache = self.cache_for(num_slots, page, req_to_token, swa)
        sync_req_to_token(cache.req_to_token, req_to_token, batch)
        if window_check_enabled(cache.device):
            check_window_held(cache, batch, self.model.config.sliding_window)
            check_pair_parity(cache, batch)
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
            gr = GraphRunner(cfg, cp)  # registered once its capture has succeeded

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
            self.graph_runners[cp.cp_size] = gr
        return gr
