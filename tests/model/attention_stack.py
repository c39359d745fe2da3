"""Attention layers alone, with the runner's slots, metadata and contexts (no model around them).

The qat tests use it: teacher-forced layers of the fixture checkpoint, CP = N against CP = 1,
chunked and mixed batches against one shot. Every CP rank builds its own stack and runs the same
steps; outputs come back as global rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import torch
from torch import Tensor

from dsv4cp.batch import PrefillBatch, RequestSlice, build_metadata
from dsv4cp.cache import KVCache, PagedAllocator
from dsv4cp.checkpoint import CheckpointReader, load_into
from dsv4cp.config import DeepseekV41Config
from dsv4cp.context import ForwardContext
from dsv4cp.cp.group import CPGroup, SingleCPGroup, gather_global
from dsv4cp.layers.attention import DeepseekV41Attention
from dsv4cp.ops.norm import rms_norm
from dsv4cp.ops.quant import check_quant_mode

R = TypeVar("R")


def load_attention(
    config: DeepseekV41Config,
    reader: CheckpointReader,
    layer: int,
    *,
    quant: str,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
) -> DeepseekV41Attention:
    """Layer `layer`'s attention with its weights read from the checkpoint (wo_a dequantized)."""
    mode = check_quant_mode(quant)
    attn = DeepseekV41Attention(config, layer, dtype=dtype, device=device, quant=mode)
    prefix = f"layers.{layer}.attn."
    slots = attn.checkpoint_slots(prefix)
    load_into(slots, reader, list(slots), dequantize=attn.checkpoint_dequantize(prefix))
    return attn


class AttentionStack:
    """One rank's attention layers with their own cache and page allocator."""

    def __init__(
        self,
        config: DeepseekV41Config,
        layers: Sequence[DeepseekV41Attention],
        *,
        cp: CPGroup | None = None,
        dtype: torch.dtype = torch.bfloat16,
        num_slots: int = 1024,
        max_context: int = 512,
        device: str = "cpu",
    ) -> None:
        self.config, self.layers = config, list(layers)
        self.cache = KVCache(
            config, num_slots, max_requests=8, max_context=max_context, dtype=dtype, device=device
        )
        self.alloc = PagedAllocator(self.cache)
        self.cp = cp or SingleCPGroup()
        self.ratios = sorted({r for r in config.layer_ratios if r})

    def step(self, requests: Mapping[str, Sequence[int]], run: Callable[[ForwardContext], R]) -> R:
        """Reserve slots for the requests' new tokens, build this rank's context, run, commit."""
        res = [self.alloc.reserve(rid, len(toks)) for rid, toks in requests.items()]
        batch = PrefillBatch(
            tuple(
                RequestSlice(rid, r.row, r.start, tuple(toks))
                for (rid, toks), r in zip(requests.items(), res)
            )
        )
        for r in res:
            self.alloc.write_table(r)
        slots = [s for r in res for s in r.slots]
        meta = build_metadata(batch, self.cache.req_to_token, slots, self.ratios)
        ctx = ForwardContext.for_rank(meta, self.cache, self.cp)
        with torch.inference_mode():
            out = run(ctx)
        for r in res:
            self.alloc.commit(r)
        return out

    def cache_rows(self, rid: str) -> dict[str, Tensor]:
        """Every cache tensor's rows of request `rid`, by position."""
        st = self.alloc.requests[rid]
        slots = self.cache.req_to_token[st.row, : st.length]
        return {k: v[slots].float().cpu() for k, v in self.cache.state_dict_view().items()}


def local_rows(ctx: ForwardContext, x: Tensor) -> Tensor:
    """This rank's rows of the global rows x [T, ...]; zeros on padding rows."""
    ids = ctx.local_ids
    rows = x[ids.clamp(min=0)]
    return rows * (ids >= 0).to(rows.dtype).view(-1, *([1] * (x.dim() - 1)))


def record(
    ctx: ForwardContext, out: dict[str, Tensor], attn: DeepseekV41Attention, key: str, rows: Tensor
) -> None:
    """out[key] = the global rows of a layer's local `rows`; an index source's top-k too."""
    out[key] = gather_global(ctx.cp, ctx.layout, rows, tag=f"test/{key}").cpu()
    if attn.role.index_source:
        topk = ctx.cross.topk[attn.role.ratio]
        name = f"topk{attn.layer}"
        out[name] = gather_global(ctx.cp, ctx.layout, topk, tag=f"test/{name}").cpu()


def run_teacher_forced(
    layers: Sequence[DeepseekV41Attention], inputs: Mapping[int, Tensor]
) -> Callable[[ForwardContext], dict[str, Tensor]]:
    """A step body: each layer's attention on its own global input rows (inputs[layer]);
    returns each layer's output and each index source's top-k as global rows."""

    def run(ctx: ForwardContext) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for attn in layers:
            y = attn(local_rows(ctx, inputs[attn.layer]), ctx)
            record(ctx, out, attn, f"attn_out{attn.layer}", y)
        return out

    return run


def run_chain(
    layers: Sequence[DeepseekV41Attention], table: Tensor, eps: float
) -> Callable[[ForwardContext], dict[str, Tensor]]:
    """A step body: h = table[token id], then h = h + attn(rms_norm(h)) layer by layer; returns
    every layer's h and each index source's top-k as global rows."""

    def run(ctx: ForwardContext) -> dict[str, Tensor]:
        assert ctx.meta.batch is not None
        ids = ctx.meta.batch.input_ids(table.device)
        h = local_rows(ctx, table[ids])
        out: dict[str, Tensor] = {}
        for attn in layers:
            h = h + attn(rms_norm(h, None, eps), ctx)
            record(ctx, out, attn, f"h{attn.layer}", h)
        return out

    return run
