"""`PrefillRunner`: batch → CP shard → model → gather of the last hidden states → logits.

Decode is an extend of one token per request. Every CP rank calls the runner with the same
requests; caches are replicated, so each rank's runner owns a full cache.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dsv4cp.batch import BatchMetadata, PrefillBatch, RequestSlice, build_metadata
from dsv4cp.cache import KVCache, PagedAllocator, Reservation
from dsv4cp.context import ForwardContext
from dsv4cp.cp.group import CPGroup, SingleCPGroup
from dsv4cp.cp.layout import CPLayout
from dsv4cp.graphs.runner import BucketReport, GraphConfig, GraphRunner, StaticBatch, embed_static
from dsv4cp.model import DeepseekV41ForCausalLM
from dsv4cp.observe.timing import StageTimer, use_timer
from dsv4cp.policy import MultistreamPolicy
from dsv4cp.schedule import StreamPool

Requests = Mapping[object, Sequence[int]] | Sequence[tuple[object, Sequence[int]]]


@dataclass
class PrefillOutput:
    logits: Tensor  # fp32 [R, V]: the last new token of each request
    all_logits: Tensor | None  # fp32 [T, V] when asked for
    hidden: Tensor  # [T, d] global rows, before the final norm
    layers: dict[str, Tensor] | None  # per-layer global hidden rows when recording
    topk: dict[int, Tensor] | None  # last top-k per ratio, global rows, when recording


def forward_tokens(
    model: DeepseekV41ForCausalLM,
    cache: KVCache,
    meta: BatchMetadata,
    input_ids: Tensor,
    cp: CPGroup,
    *,
    policy: MultistreamPolicy,
    streams: StreamPool | None,
    record: bool = False,
    lane_hook: object | None = None,
) -> tuple[Tensor, ForwardContext]:
    """One eager forward of a batch whose slots and `req_to_token` rows are already written:
    CP shard → every layer → gather of the last hidden rows, global order [T, d]."""
    layout = CPLayout.build(meta.tokens.num_rows, cp.cp_size).to(cache.device)
    local_ids = layout.local_token_ids(cp.rank)
    ctx = ForwardContext(
        cache=cache,
        meta=meta,
        local=meta.tokens.take(local_ids),
        cp=cp,
        layout=layout,
        multistream=policy.decide(layout.padded_rows, graphs=False, cuda=streams is not None),
        streams=streams,
        policy=policy,
        record={} if record else None,
        lane_hook=lane_hook,
    )
    ids = torch.where(local_ids >= 0, input_ids[local_ids.clamp(min=0)], 0)
    h = model.forward_hidden(model.embed_tokens(ids), ctx)
    return ctx.gather(h, "final/hidden"), ctx


class PrefillRunner:
    def __init__(
        self,
        model: DeepseekV41ForCausalLM,
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
            max_requests=max_requests,
            max_context=max_context,
            page_size=page_size,
            device=model.device,
            dtype=model.dtype,
        )
        self.alloc = PagedAllocator(self.cache)
        self.cp = cp or SingleCPGroup()
        # True/False force the executor; "auto" (or DSV4CP_MULTISTREAM) asks the policy per batch.
        if isinstance(multistream, str):
            self.policy = MultistreamPolicy.from_env(multistream)
        else:
            self.policy = MultistreamPolicy(mode="on" if multistream else "off")
        self.streams: StreamPool | None = None
        if self.policy.mode == "on" and model.device.type != "cuda":
            raise ValueError("multistream needs a CUDA device (CPU runs the serial schedule)")
        if self.policy.mode != "off" and model.device.type == "cuda":
            self.streams = model.stream_pool()
        self.ratios = sorted({r for r in model.config.layer_ratios if r})
        self.lane_hook = None  # tests: callable(lane) at the start of every lane (multistream)
        self.graph_runner: GraphRunner | None = None
        if graphs is True:
            graphs = GraphConfig()
        if graphs:  # None / False: eager only
            self.capture_graphs(graphs)

    # ------------------------------------------------------------------ prefill
    def _normalise(self, requests: Requests) -> list[tuple[object, list[int]]]:
        items = list(requests.items()) if isinstance(requests, Mapping) else list(requests)
        if not items:
            raise ValueError("prefill: empty batch (no requests)")
        out = []
        vocab = self.model.config.vocab_size
        seen = set()
        for rid, toks in items:
            if rid in seen:
                raise ValueError(f"prefill: request {rid!r} appears twice in one batch")
            seen.add(rid)
            toks = [int(t) for t in toks]
            if not toks:
                raise ValueError(f"prefill: request {rid!r} has no new tokens")
            bad = [t for t in toks if not 0 <= t < vocab]
            if bad:
                raise ValueError(
                    f"prefill: request {rid!r} has token id {bad[0]} outside [0, {vocab})"
                )
            out.append((rid, toks))
        return out

    def _check_same_batch(self, items: list[tuple[object, list[int]]], starts: list[int]) -> None:
        if self.cp.cp_size == 1:
            return
        h = 0
        for (rid, toks), s in zip(items, starts):
            h = zlib.crc32(repr((rid, s, toks)).encode(), h)
        mine = torch.tensor(
            [[len(items), sum(len(t) for _, t in items), h]],
            dtype=torch.long,
            device=self.cache.device,
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
        record: bool = False,
        timer: StageTimer | None = None,
    ) -> PrefillOutput:
        items = self._normalise(requests)
        starts = list(starts) if starts is not None else [None] * len(items)
        if len(starts) != len(items):
            raise ValueError("prefill: starts must have one entry per request")
        reservations: list[Reservation] = []
        try:
            for (rid, toks), s in zip(items, starts):
                reservations.append(self.alloc.reserve(rid, len(toks), s))
            self._check_same_batch(items, [r.start for r in reservations])
            for res in reservations:
                self.alloc.write_table(res)
            with use_timer(timer):
                out = self._forward(items, reservations, return_all_logits, record, timer is None)
        except BaseException:
            for res in reversed(reservations):
                self.alloc.rollback(res)
            raise
        for res in reservations:
            self.alloc.commit(res)
        return out

    def _forward(
        self,
        items: list[tuple[object, list[int]]],
        reservations: list[Reservation],
        return_all_logits: bool,
        record: bool,
        graphs_ok: bool,
    ) -> PrefillOutput:
        model, cache = self.model, self.cache
        batch = PrefillBatch(
            tuple(
                RequestSlice(rid, res.row, res.start, tuple(toks))
                for (rid, toks), res in zip(items, reservations)
            )
        )
        slots = [s for res in reservations for s in res.slots]
        meta = build_metadata(batch, cache.req_to_token, slots, self.ratios)
        input_ids = batch.input_ids(cache.device)
        with torch.inference_mode():
            bg = None
            if self.graph_runner is not None and not record and graphs_ok:
                bg = self.graph_runner.select(meta)
            layers = topk = None
            if bg is not None:
                hidden = self.graph_runner.replay(bg, meta, input_ids)
            else:
                hidden, layers, topk = self._eager(meta, input_ids, record)
            rows = batch.last_token_rows()
            logits = model.logits(hidden[rows])
            all_logits = model.logits(hidden) if return_all_logits else None
        return PrefillOutput(logits, all_logits, hidden, layers, topk)

    def _eager(
        self, meta: BatchMetadata, input_ids: Tensor, record: bool
    ) -> tuple[Tensor, dict[str, Tensor] | None, dict[int, Tensor] | None]:
        hidden, ctx = forward_tokens(
            self.model,
            self.cache,
            meta,
            input_ids,
            self.cp,
            policy=self.policy,
            streams=self.streams,
            record=record,
            lane_hook=self.lane_hook,
        )
        layers = topk = None
        if record:
            layers = {k: ctx.gather(v, f"record/{k}") for k, v in ctx.record.items()}
            topk = {r: ctx.gather(t, f"record/topk{r}") for r, t in sorted(ctx.topk.items())}
        return hidden, layers, topk

    # ------------------------------------------------------------------ graphs
    def _graph_body(self, static: StaticBatch) -> Tensor:
        h, local = embed_static(self.model.embed, static)
        ctx = ForwardContext(
            cache=self.cache,
            meta=static.meta,
            local=local,
            cp=self.cp,
            layout=static.layout,
            multistream=self.policy.decide(static.layout.padded_rows, graphs=True, cuda=True),
            streams=self.streams,
            policy=self.policy,
            overlap_gathers=bool(getattr(self.cp, "capturable", False)),
        )
        h = self.model.forward_hidden(h, ctx)
        return ctx.gather(h, "final/hidden")

    def capture_graphs(self, config: GraphConfig) -> list[BucketReport]:
        """Capture every bucket (largest first, one pool); every CP rank calls this together."""
        if self.model.device.type != "cuda":
            raise ValueError("graphs need a CUDA device")
        self.graph_runner = GraphRunner(config)
        with torch.inference_mode():
            return self.graph_runner.capture(
                self._graph_body,
                lambda b: StaticBatch(b, config, self.cache.req_to_token, self.ratios, self.cp),
                self.cp.barrier,
            )

    # ------------------------------------------------------------------ decode
    def decode(self, last_tokens: Mapping[object, int]) -> PrefillOutput:
        """One greedy step: an extend of one token per request."""
        return self.prefill({rid: [tok] for rid, tok in last_tokens.items()})

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        rids: Sequence[object] | None = None,
    ) -> list[list[int]]:
        """Greedy generation: prefill every prompt in one batch, then decode step by step."""
        rids = list(rids) if rids is not None else [f"gen{i}" for i in range(len(prompts))]
        out = self.prefill(list(zip(rids, prompts)))
        tokens = [[int(t)] for t in out.logits.argmax(-1).tolist()]
        for _ in range(max_new_tokens - 1):
            out = self.decode({rid: toks[-1] for rid, toks in zip(rids, tokens)})
            for toks, t in zip(tokens, out.logits.argmax(-1).tolist()):
                toks.append(int(t))
        return tokens

    def release(self, rid: object) -> None:
        self.alloc.free(rid)
