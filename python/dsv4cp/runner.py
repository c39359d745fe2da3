"""`PrefillRunner`: allocation, graphs and logits around the model's one forward.

prefill: validate → reserve slots → metadata → `model.forward` (eager, or a captured bucket
replayed) → logits of each request's last token → commit (or roll back). Decode is an extend of
one token per request. Every CP rank calls the runner with the same requests; caches are
replicated, so each rank's runner owns a full cache.
"""

from __future__ import annotations

import itertools
import operator
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dsv4cp.batch import BatchMetadata, PrefillBatch, RequestSlice, build_metadata
from dsv4cp.cache import KVCache, PagedAllocator, Reservation
from dsv4cp.context import ForwardContext
from dsv4cp.cp.group import CPGroup, SingleCPGroup
from dsv4cp.executors import ExecutorFactory
from dsv4cp.graphs.runner import BucketReport, GraphConfig, GraphRunner, StaticBatch
from dsv4cp.model import DeepseekV41Model
from dsv4cp.observe.timing import StageTimer, use_timer

Requests = Mapping[Any, Sequence[int]] | Sequence[tuple[Any, Sequence[int]]]


def _token_id(rid: object, t: object) -> int:
    """One token id: an int (Python, numpy or a one-element integer tensor). A float (1.7), a
    bool or a string ("5") is a ValueError, never truncated or parsed."""
    if isinstance(t, Tensor):
        ok = t.numel() == 1 and not t.is_floating_point() and t.dtype != torch.bool
    else:
        ok = not isinstance(t, bool) and hasattr(t, "__index__")
    if not ok:
        what = f"a tensor {t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else repr(t)
        raise ValueError(
            f"prefill: request {rid!r} has token id {what} of type {type(t).__name__}; "
            "token ids must be ints"
        )
    return int(t.item()) if isinstance(t, Tensor) else int(t)  # type: ignore[call-overload]


@dataclass
class PrefillOutput:
    logits: Tensor  # fp32 [R, V]: the last new token of each request
    all_logits: Tensor | None  # fp32 [T, V] when asked for
    hidden: Tensor  # [T, d] global rows, before the final norm


def _items(requests: object) -> list[object]:
    if isinstance(requests, (str, bytes, bytearray)) or not hasattr(requests, "__iter__"):
        raise ValueError(
            "prefill: requests must be a mapping rid → token ids or a sequence of (rid, token "
            f"ids) pairs, got {type(requests).__name__}"
        )
    return list(requests)


def _request_pair(i: int, item: object) -> tuple[object, object]:
    """Item `i` of a sequence of requests as (rid, token ids); a ValueError naming the index if
    it is not a pair or its rid is not hashable (request ids key the allocator's table)."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise ValueError(
            f"prefill: request {i} is {item!r}: each request must be a (rid, token ids) pair "
            "(a list of prompts needs ids: pass a mapping rid → token ids, or use generate)"
        )
    rid, toks = item
    if not _hashable(rid):
        raise ValueError(
            f"prefill: request {i} has rid {rid!r} of type {type(rid).__name__}, which is not "
            "hashable; request ids must be hashable (str, int, tuple, ...)"
        )
    return rid, toks


def _hashable(rid: object) -> bool:
    """Whether `rid` can key the allocator's table of requests."""
    try:
        hash(rid)
    except TypeError:
        return False
    return True


def _token_seq(rid: object, toks: object) -> list[object]:
    """The token ids of request `rid` as a list: a non-string sequence (list, tuple, range,
    1-d tensor or array); a string, a mapping, a set or a scalar is a ValueError."""
    if not isinstance(toks, (str, bytes, bytearray, Mapping, set, frozenset)):
        try:
            return list(toks)  # type: ignore[call-overload]
        except TypeError:  # not iterable: an int, a 0-d tensor, None
            pass
    raise ValueError(
        f"prefill: request {rid!r}: token ids must be a sequence of ints, got "
        f"{type(toks).__name__} {toks!r:.40}"
    )


def _start_of(i: int, s: object) -> int | None:
    """starts[i] as an int (numpy ints too) or None; ValueError for a bool, a float, a str."""
    if s is None:
        return None
    if not isinstance(s, bool):
        try:
            return operator.index(s)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise ValueError(f"prefill: starts[{i}] must be an int or None, got {s!r}")


class PrefillRunner:
    def __init__(
        self,
        model: DeepseekV41Model,
        cache: KVCache | None = None,
        *,
        cp: CPGroup | None = None,
        multistream: bool | str = False,
        num_slots: int = 4096,
        max_requests: int = 64,
        max_context: int = 4096,
        page_size: int = 16,
        graphs: bool | GraphConfig | None = None,
    ) -> None:
        self.model = model
        self.cache = cache or KVCache(
            model.config,
            num_slots,
            quant=getattr(model, "quant", "none"),  # the caches store the model's numerics
            max_requests=max_requests,
            max_context=max_context,
            page_size=page_size,
            device=model.device,
            dtype=model.dtype,
        )
        self.alloc = PagedAllocator(self.cache)
        self.cp = cp or SingleCPGroup()
        # True/False force the executor; "auto" (or DSV4CP_MULTISTREAM) asks the policy per batch.
        self.executors = ExecutorFactory.create(
            multistream, device=model.device, lanes=model.prepare_lanes()
        )
        self.ratios = sorted({r for r in model.config.layer_ratios if r})
        self.graph_runner: GraphRunner | None = None
        if graphs is True:
            graphs = GraphConfig()
        if graphs:  # None / False: eager only
            self.capture_graphs(graphs)

    # ------------------------------------------------------------------ prefill
    def _token_lists(self, requests: Requests) -> list[tuple[object, list[int]]]:
        """(rid, token ids) per request: each item a (hashable rid, non-string sequence of int
        ids) pair, the ids checked against the vocabulary here, on the host (the batch's shape
        is checked by `PrefillBatch`). Nothing is reserved yet: a ValueError leaves the cache
        as it was."""
        items = list(requests.items()) if isinstance(requests, Mapping) else _items(requests)
        out = []
        vocab = self.model.config.vocab_size
        for i, item in enumerate(items):
            rid, toks = _request_pair(i, item)
            ids = [_token_id(rid, t) for t in _token_seq(rid, toks)]
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(
                    f"prefill: request {rid!r} has token id {bad[0]} outside [0, {vocab})"
                )
            out.append((rid, ids))
        return out

    def _check_same_batch(self, batch: PrefillBatch) -> None:
        if self.cp.cp_size == 1:
            return
        h = 0
        for r in batch.requests:
            h = zlib.crc32(repr((r.rid, r.start, r.token_ids)).encode(), h)
        mine = torch.tensor(
            [[len(batch.requests), batch.num_tokens, h]], dtype=torch.long, device=self.cache.device
        )
        every = self.cp.all_gather(mine, tag="batch/metadata").view(-1, 3)
        if not bool((every == every[:1]).all()):
            raise ValueError(
                "prefill: CP ranks were given different batches (request count, token count or "
                f"content hash differ: {every.tolist()}); every rank must see the same batch"
            )

    def prefill(
        self,
        requests: Requests,
        *,
        starts: Sequence[int | None] | None = None,
        return_all_logits: bool = False,
        timer: StageTimer | None = None,
    ) -> PrefillOutput:
        """`timer` times every stage of an eager forward (`observe.timing.stage`)."""
        items = self._token_lists(requests)
        starts = list(starts) if starts is not None else [None] * len(items)
        if len(starts) != len(items):
            raise ValueError("prefill: starts must have one entry per request")
        starts = [_start_of(i, s) for i, s in enumerate(starts)]
        reservations, batch = self._reserve(items, starts)
        try:
            self._check_same_batch(batch)
            for res in reservations:
                self.alloc.write_table(res)
            with use_timer(timer):
                eager = timer is not None or self.model.hooked
                out = self._forward(batch, reservations, return_all_logits, eager)
        except BaseException:
            self._rollback(reservations)
            raise
        for res in reservations:
            self.alloc.commit(res)
        return out

    def _reserve(
        self, items: list[tuple[object, list[int]]], starts: Sequence[int | None]
    ) -> tuple[list[Reservation], PrefillBatch]:
        """Reserve every request's slots (positions, the cache's room) and build the batch (its
        shape: no empty request, no duplicate): every check of a prefill before a write. If one
        fails, what was reserved is rolled back and the error raised."""
        reservations: list[Reservation] = []
        try:
            for (rid, toks), s in zip(items, starts):
                reservations.append(self.alloc.reserve(rid, len(toks), s))
            batch = PrefillBatch(
                tuple(
                    RequestSlice(rid, res.row, res.start, tuple(toks))
                    for (rid, toks), res in zip(items, reservations)
                )
            )
        except BaseException:
            self._rollback(reservations)
            raise
        return reservations, batch

    def _rollback(self, reservations: list[Reservation]) -> None:
        for res in reversed(reservations):
            self.alloc.rollback(res)

    def _forward(
        self,
        batch: PrefillBatch,
        reservations: list[Reservation],
        return_all_logits: bool,
        eager: bool,
    ) -> PrefillOutput:
        model, cache = self.model, self.cache
        slots = [s for res in reservations for s in res.slots]
        meta = build_metadata(batch, cache.req_to_token, slots, self.ratios)
        input_ids = batch.input_ids(cache.device)
        with torch.inference_mode():
            gr = self.graph_runner
            bg = gr.select(meta) if gr is not None and not eager else None
            if gr is not None and bg is not None:
                hidden = gr.replay(bg, meta, input_ids)
            else:
                hidden = self._eager(meta, input_ids)
            rows = batch.last_token_rows()
            logits = model.logits(hidden[rows])
            all_logits = model.logits(hidden) if return_all_logits else None
        return PrefillOutput(logits, all_logits, hidden)

    def _eager(self, meta: BatchMetadata, input_ids: Tensor) -> Tensor:
        ctx = ForwardContext.for_rank(meta, self.cache, self.cp)
        executors = self.executors.choose(ctx.local_rows, graphs=False)
        return self.model.forward(input_ids, ctx, executors)

    # ------------------------------------------------------------------ graphs
    def _graph_body(self, static: StaticBatch) -> Tensor:
        """What a bucket's graph captures: the same forward on the bucket's static inputs."""
        gr = self.graph_runner
        if gr is None:
            raise ValueError("_graph_body: no graph runner (capture_graphs makes one)")
        ctx = ForwardContext.for_rank(
            static.meta, self.cache, gr.cp, layout=static.layout, local_ids=static.local_ids
        )
        executors = self.executors.choose(
            ctx.local_rows, graphs=True, overlap_gathers=gr.overlap_gathers
        )
        return self.model.forward(static.ids, ctx, executors)

    def capture_graphs(self, config: GraphConfig) -> list[BucketReport]:
        """Capture every bucket (largest first, one pool); every CP rank calls this together."""
        if self.model.device.type != "cuda":
            raise ValueError("graphs need a CUDA device")
        if self.model.engram_layers:
            raise ValueError(
                "graphs: Engram layers read their tables on the host (distinct rows of a memmap), "
                "which a CUDA graph cannot capture; run this model eagerly"
            )
        self.graph_runner = GraphRunner(config, self.cp)
        with torch.inference_mode():
            return self.graph_runner.capture(
                self._graph_body,
                lambda b: StaticBatch(b, config, self.cache.req_to_token, self.ratios, self.cp),
                self.cp.barrier,
            )

    # ------------------------------------------------------------------ decode
    def decode(self, last_tokens: Mapping[object, int]) -> PrefillOutput:
        """One greedy step: an extend of one token per live request. An id that is not live
        (never prefilled, or released) is a ValueError: prefill starts requests, decode continues
        them."""
        unknown = [rid for rid in last_tokens if rid not in self.alloc.requests]
        if unknown:
            raise ValueError(
                f"decode: request {unknown[0]!r} is not live (start it with prefill; a released "
                "request is gone)"
            )
        return self.prefill({rid: [tok] for rid, tok in last_tokens.items()})

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        rids: Sequence[object] | None = None,
    ) -> list[list[int]]:
        """Greedy generation: prefill every prompt in one batch, then decode step by step.

        Every prompt is a new request: `rids` (default: `gen<i>` ids that are not live) must not
        be live, and every request is released when generate returns or raises, so a later call
        never continues a stale one. `max_new_tokens` 0 returns [] per prompt (the prompts are
        still checked; nothing runs), a negative count is a ValueError."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise ValueError(f"generate: max_new_tokens must be an int, got {max_new_tokens!r}")
        if max_new_tokens < 0:
            raise ValueError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
        rids = self._generate_rids(len(prompts), rids)
        items = self._token_lists(list(zip(rids, prompts)))
        if max_new_tokens == 0:  # checked as a prefill would (empty, too long), nothing runs
            self._rollback(self._reserve(items, [None] * len(items))[0])
            return [[] for _ in items]
        try:
            out = self.prefill(items)
            tokens = [[int(t)] for t in out.logits.argmax(-1).tolist()]
            for _ in range(max_new_tokens - 1):
                out = self.decode({rid: toks[-1] for rid, toks in zip(rids, tokens)})
                for toks, t in zip(tokens, out.logits.argmax(-1).tolist()):
                    toks.append(int(t))
        finally:
            for rid in rids:
                if rid in self.alloc.requests:
                    self.release(rid)
        return tokens

    def _generate_rids(self, n: int, rids: Sequence[object] | None) -> list[object]:
        live = self.alloc.requests
        if rids is None:
            fresh = (f"gen{i}" for i in itertools.count())
            return list(itertools.islice((r for r in fresh if r not in live), n))
        out = list(rids)
        if len(out) != n:
            raise ValueError(f"generate: {len(out)} rids for {n} prompts")
        for i, r in enumerate(out):
            if not _hashable(r):
                raise ValueError(
                    f"generate: rid {i} ({r!r}) is not hashable: a request id is a dict key"
                )
        busy = [r for r in out if r in live]
        if busy:
            raise ValueError(
                f"generate: request {busy[0]!r} is live; generate starts new requests (release "
                "it, or continue it with decode)"
            )
        return out

    def release(self, rid: object) -> None:
        self.alloc.free(rid)
