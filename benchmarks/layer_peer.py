"""Per-layer peer benchmark (issue 15): dsv4cp's attention layer against SGLang 0.5.23's Hopper
V4.1 path rebuilt from its parts, and against each layer's floor, at V4.1-Flash dims, bf16.

    PYTHONPATH=python python -m benchmarks.layer_peer --out out/layer_peer.json
    PYTHONPATH=/tmp/site:python python -m benchmarks.layer_peer ...    # FlashMLA installed there
    PYTHONPATH=python python -m benchmarks.layer_peer --smoke           # the script, CPU, tiny

One request per case: a cold prefill of 4K / 16K / 64K tokens, and a 16K-token chunk after a
112K- and a 496K-token cached prefix (the caches are filled with random values of their storage
dtype instead of prefilling the prefix). Roles: the Flash config's layers 0 (SWA, the forward's
first layer), 1 (SWA, as every later SWA layer: it finds the window's rows made), 2 (ratio-2 kv +
index source), 3 (ratio-2 top-k reuse), 20 (ratio-1 kv + candidate source), 21 (ratio-1 reuse),
24 (ratio-1 candidate consumer), run in that order so each reads what the earlier ones left.

- dsv4cp: `DeepseekV41Attention.forward` (prepare → sparse attention → output) in its best
  path: `--quant qat` (default; the released numerics, quantized caches: fp8 SWA rows, fp4
  compressed and index rows), best of the serial and multistream executors, each a CUDA-graph
  replay (eager where capture fails). Its ops come through `dsv4cp.routing`: sparse attention is
  FlashMLA's sparse prefill over the chunk-bounded bf16 workspace where `flash_mla` imports
  (`kernels/flashmla.py`; else the Triton cached kernel), the index node the fused logits +
  running top-k over the decoded index-K workspace (`kernels/indexer_topk_cached.mqa_topk_cached`).
- peer: the same layer object with its indexer node replaced by SGLang's torch indexer (bf16
  einsum scores, torch.topk; torch candidate publish / consume) and its sparse attention by
  FlashMLA (`flash_mla_sparse_fwd`, legacy SM90 kernels), eager as SGLang runs it, plus the
  bf16 workspace SGLang builds (the window rows every layer, the compressed entries on kv
  sources; timed as a gather). Same projection GEMMs and cache writes as dsv4cp
  (`benchmarks/sglang_peer.py` says what is SGLang's and what is not). Needs `flash_mla`; without
  it the peer is skipped with a message.
- floor: the layer's GEMMs timed in this run (one captured chain) plus its attention FLOPs —
  sparse attention 2·H·(512 + 512) per valid index, indexer 2·H_I·D_I per scored key (a consumer:
  at most its candidate positions) — at the bf16 GEMM rate measured here (8192³).
- components per layer: the indexer step (the layer's fused node, the unfused chunks it
  replaced: `mqa_logits_cached` + selection, peer), sparse attention on the layer's own inputs
  (the layer's routed call = FlashMLA over its workspace incl. building it; the Triton cached
  kernel on the caches; the dense Triton kernel and FlashMLA on pre-decoded dense rows).
- Layers run in order on one context, so each finds what the earlier ones left in
  `ctx.cross.attention` as in the model's forward: the SWA store's rows, the window's rows, a
  reuse layer its top-k's compressed rows and the FlashMLA workspace of its group's first layer
  (it decodes only its own SWA rows); the run's first layer starts empty on every call (it
  numbers the window and the store's rows).
- CP rows (case chunk16k@112k): rank 0's time at CP = 4 and 8 (`SoloCPGroup`: one GPU, gathers
  tile the local shard; compute only; best of the executors, each named) against (CP 1 time) /
  N. Each of `--cp-repeats` repeats runs a CP 1 pass, then the ranks: the CP 1 time is the mean
  of all CP 1 samples (the first pass's too), the rank time the median of the repeats', and
  each repeat's ratio is kept with their min and max. `auto_*`: the same for the executor that
  the `auto` multistream policy runs for the role at the rank's rows inside graphs (what
  SGLang's default and `PrefillRunner(multistream="auto")` run); the CP targets are judged on
  it. `forward_mix`: the CP rows summed over the config's whole layer mix, each layer as its
  role's measured layer (`benchmarks/forward_mix.py`): a forward's attention per rank.
- `--keep-bf16-weights`: the layers hold bf16 copies of their fp8 projections
  (`Linear.keep_dequantized`, what $DSV4CP_KEEP_BF16_WEIGHTS asks of the loader), so the GEMMs
  skip the per-call weight dequantization; the peer shares the layer's projections, so both.

Every case and layer is guarded: a failure is printed and recorded, the run goes on, and the
JSON is written at the end (also when `--budget-s` runs out: the rest is marked skipped). A
`--layers` list that cannot run (not in model order, or without the layer whose top-k or
candidates one of them reads) is refused before any work.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import forward_mix, sglang_peer
from benchmarks.benchutil import Table, device_info, time_cuda, time_graph, write_json
from benchmarks.prefill import SoloCPGroup
from dsv4cp import ops, routing
from dsv4cp.batch import PrefillBatch, RequestSlice, build_metadata
from dsv4cp.cache import KVCache
from dsv4cp.config import DeepseekV41Config
from dsv4cp.context import AttentionMemo, ForwardContext
from dsv4cp.cp.group import SingleCPGroup
from dsv4cp.executors import (
    SERIAL,
    Executor,
    ExecutorFactory,
    MultistreamExecutor,
    StreamPool,
)
from dsv4cp.layers import attention as layer_module
from dsv4cp.layers.attention import DeepseekV41Attention
from dsv4cp.layers.linear import keep_dequantized_weights
from dsv4cp.model import init_random_
from dsv4cp.ops.quant import QuantMode
from dsv4cp.policy import MultistreamPolicy
from dsv4cp.roles import LayerRole
from dsv4cp.schedule import PrepareState, lanes_of

CASES: dict[str, tuple[int, int]] = {  # name: (cached prefix, new tokens)
    "cold4k": (0, 4096),
    "cold16k": (0, 16384),
    "cold64k": (0, 65536),
    "chunk16k@112k": (112 * 1024, 16384),
    "chunk16k@496k": (496 * 1024, 16384),
}
LAYERS = (0, 1, 2, 3, 20, 21, 24)
CP_CASE, CP_SIZES = "chunk16k@112k", (4, 8)
SMOKE_CASES = {"cold48": (0, 48), "chunk32@80": (80, 32)}
SMOKE_LAYERS = (0, 1, 2, 3, 4, 5)  # the tiny config's roles (one SWA layer), in LAYERS' order
SMOKE_CP_CASE = "chunk32@80"
LOGITS_BUDGET_BYTES = 256 << 20  # the unfused node's fp32 logits per row chunk (as it was)
FUSED_SWEEP = ((64, 128, 4, 2), (64, 128, 8, 2), (64, 64, 4, 2), (64, 128, 4, 3))


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


# ------------------------------------------------------------------------------ set-up


def build_layers(
    cfg: DeepseekV41Config,
    ids: tuple[int, ...],
    dtype: torch.dtype,
    device: str,
    quant: QuantMode = "none",
) -> dict[int, DeepseekV41Attention]:
    layers = {i: DeepseekV41Attention(cfg, i, dtype=dtype, device=device, quant=quant) for i in ids}
    weights = {
        f"layers.{i}.attn.{n}": t
        for i, a in layers.items()
        for n, t in a.checkpoint_weights().items()
    }
    init_random_(weights, cfg, 0, device=device)
    return layers


def fill_random_(cache: KVCache, seed: int) -> None:
    """Every cache tensor gets random values of its storage dtype: floats N(0, 1); quantized key
    rows (uint8 codes + scales) the encoding of N(0, 1) keys, in slices of rows."""
    g = torch.Generator(device=cache.device).manual_seed(seed)
    pools = {"swa": cache.swa, "compressed": cache.compressed, "index": cache.index}
    encoded: set[int] = set()
    for kind, by_layer in pools.items():
        if cache.formats.of(kind) == "dense":  # type: ignore[arg-type]
            continue
        dim = cache.dims()[kind]  # type: ignore[index]
        for t in by_layer.values():
            for a in range(0, t.shape[0], 1 << 16):
                b = min(t.shape[0], a + (1 << 16))
                keys = torch.randn(b - a, dim, generator=g, device=t.device)
                t[a:b] = cache.encode(kind, keys)  # type: ignore[arg-type]
            encoded.add(id(t))
    for name, t in sorted(cache.state_dict_view().items()):
        if name == "swa_page_table" or id(t) in encoded:  # addressing, or done above
            continue
        if t.dtype in (torch.float32, torch.bfloat16, torch.float16):
            t.normal_(generator=g)
        elif t.is_floating_point():  # fp8 storage
            t.copy_(torch.randn(t.shape, generator=g, device=t.device).to(t.dtype))
        elif "scale" in name:
            t.copy_(torch.randint(124, 131, t.shape, generator=g, device=t.device).to(t.dtype))
        else:
            codes = torch.randint(0, 0x7F, t.shape, generator=g, device=t.device)
            sign = torch.randint(0, 2, t.shape, generator=g, device=t.device) * 0x80
            t.copy_((codes + sign).to(t.dtype))


def make_context(
    cfg: DeepseekV41Config,
    prefix: int,
    tokens: int,
    device: str,
    dtype: torch.dtype,
    quant: QuantMode = "none",
) -> ForwardContext:
    total = prefix + tokens
    cache = KVCache(
        cfg,
        total + 64,
        quant=quant,
        max_requests=1,
        max_context=total + 16,
        device=device,
        dtype=dtype,
    )
    cache.req_to_token[0, :total] = torch.arange(1, total + 1, device=device)
    fill_random_(cache, seed=total)
    batch = PrefillBatch((RequestSlice("r", 0, prefix, tuple(range(tokens))),))
    slots = torch.arange(prefix + 1, total + 1)
    meta = build_metadata(batch, cache.req_to_token, slots, (1, 2))
    return ForwardContext.for_rank(meta, cache, SingleCPGroup())


# ------------------------------------------------------------------------------ the layer's parts


def index_workspace(layer: DeepseekV41Attention, ctx: ForwardContext) -> torch.Tensor:
    """The ratio's index keys as a dense workspace [entries, D_I] (decoded from the kv source's
    index cache): what the fused kernels read. The layer itself reads the cache through the
    entries' rows (`mqa_logits_cached`), so this gather is the fused path's extra cost."""
    cache, r = ctx.cache, layer.role.ratio
    src = layer.role.kv_source
    assert src is not None
    rows = cache.entry_rows(r, ctx.meta.workspaces[r].slots)
    return cache.decode("index", cache.index[src][rows]).to(cache.dtype)


def dense_attention_args(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """`sparse_attention_cached`'s arguments as `sparse_attention`'s (q, kv, indices, sink,
    scale): the rows it reads decoded into one dense bf16 KV (what FlashMLA and the dense
    Triton kernel take)."""
    q, swa, win, comp, comp_idx, sink, scale, swa_fmt, comp_fmt = args[:9]
    d = q.shape[-1]
    from dsv4cp.ops.kv_format import decode_rows

    parts, idx = [decode_rows(swa, swa_fmt, d).to(q.dtype)], [win]
    if comp is not None:
        parts.append(decode_rows(comp, comp_fmt, d).to(q.dtype))
        idx.append(torch.where(comp_idx >= 0, comp_idx + swa.shape[0], -1))
    return q, torch.cat(parts), torch.cat(idx, 1).to(torch.int32), sink, scale


def unfused_logits_topk(layer: DeepseekV41Attention, st: PrepareState) -> None:
    """The index node as it was before the fused kernel reached the layer: fp32 logits
    (`mqa_logits_cached`, row chunks of LOGITS_BUDGET_BYTES) to memory, then the selection ops."""
    ctx = st.ctx
    cfg, r = layer.config, layer.role.ratio
    n_vis = ctx.local.n_visible(r)
    width = max(ctx.meta.workspaces[r].max_entries, 1)
    rows = ctx.local.num_rows
    chunk = max(1, min(rows, LOGITS_BUDGET_BYTES // (4 * width)))
    topk_parts, cand_parts = [], []
    for a in range(0, rows, chunk):
        b = min(rows, a + chunk)
        logits = layer.index_logits(st["idx_q"][a:b], st["idx_w"][a:b], ctx, slice(a, b))
        if layer.role.candidate_consumer:
            blocks = ctx.cross.candidates[r][a:b]
            topk_parts.append(
                routing.topk_among_blocks(
                    logits, n_vis[a:b], blocks, cfg.candidate_block_size, cfg.index_topk
                )
            )
        else:
            topk_parts.append(routing.topk_indices(logits, n_vis[a:b], cfg.index_topk))
        if layer.role.candidate_source:
            cand_parts.append(
                routing.candidate_blocks(
                    logits, n_vis[a:b], cfg.candidate_block_size, cfg.candidate_topk_blocks
                )
            )
    ctx.cross.topk[r] = st["topk"] = torch.cat(topk_parts)
    if cand_parts:
        ctx.cross.candidates[r] = torch.cat(cand_parts)


@contextmanager
def patched(
    layer: DeepseekV41Attention,
    *,
    logits_topk: Callable[[DeepseekV41Attention, PrepareState], None] | None = None,
    attention: Callable[..., torch.Tensor] | None = None,
) -> Iterator[None]:
    """Run `layer` with its index node and/or its sparse attention call replaced."""
    if not hasattr(layer_module, "sparse_attention_cached") or not hasattr(layer, "_logits_topk"):
        raise RuntimeError(
            "layers/attention.py no longer has `sparse_attention_cached` / `_logits_topk`: "
            "update benchmarks/layer_peer.py's patch points"
        )
    saved = layer_module.sparse_attention_cached
    try:
        if logits_topk is not None:

            def _logits_topk(st: PrepareState) -> None:  # the node keeps its name
                logits_topk(layer, st)

            layer._logits_topk = _logits_topk  # type: ignore[method-assign]
            layer.schedules.clear()
        if attention is not None:
            layer_module.sparse_attention_cached = attention
        yield
    finally:
        layer.__dict__.pop("_logits_topk", None)
        layer.schedules.clear()
        layer_module.sparse_attention_cached = saved


def gemm_chain(layer: DeepseekV41Attention, x: torch.Tensor) -> tuple[Callable[[], None], float]:
    """The layer's GEMMs on random activations of the right shapes, and their FLOPs."""
    cfg, role = layer.config, layer.role
    t, dev, dt = x.shape[0], x.device, x.dtype
    h, d = layer.n_heads, layer.head_dim
    q_lora = torch.randn(t, cfg.q_lora_rank, device=dev, dtype=dt)
    o = torch.randn(t, h, d, device=dev, dtype=dt)
    entries = t // role.ratio if role.owns_compressor else 0
    latent = torch.randn(entries, d, device=dev, dtype=dt)

    # F.linear(a [m, k], W [n, k]) is 2·m·W.numel() FLOPs; the grouped wo_a einsum likewise.
    def dense(w: torch.Tensor) -> torch.Tensor:  # fp8 storage timed as bf16 GEMMs (the floor)
        return w if w.dtype == dt else w.to(dt)

    wqkv_a, wq_b, wo_b = (dense(m.weight) for m in (layer.wqkv_a, layer.wq_b, layer.wo_b))
    idx_wq_b = dense(layer.idx_wq_b.weight) if role.index_source else None
    flops = 2.0 * t * (wqkv_a.numel() + wq_b.numel())
    flops += 2.0 * t * (layer.wo_a.numel() + wo_b.numel())
    if role.owns_compressor:
        flops += 2.0 * t * layer.comp_wkv.numel() + 2.0 * entries * layer.idx_wk.numel()
    if role.index_source:
        flops += 2.0 * t * (layer.idx_wq_b.weight.numel() + layer.idx_weights_proj.numel())

    def run() -> None:
        F.linear(x, wqkv_a)
        if role.owns_compressor:
            if role.ratio == 2:
                routing.linear_fp32(x, layer.comp_wkv)
            else:
                F.linear(x, layer.comp_wkv)
            F.linear(latent, layer.idx_wk)
        F.linear(q_lora, wq_b)
        if role.index_source:
            F.linear(q_lora, idx_wq_b)
            F.linear(x, layer.idx_weights_proj)
        ops.grouped_output(o, layer.wo_a, wo_b, cfg.o_groups)

    return run, flops


# ------------------------------------------------------------------------------ timing


class Timer:
    """Median ms of a call: CUDA-graph replays where asked and capturable, else eager; the number
    of timed calls shrinks for slow calls so that one measurement takes about `target_s`."""

    def __init__(self, device: str, iters: int, target_s: float) -> None:
        self.device, self.iters, self.target_s = device, iters, target_s

    def __call__(self, fn: Callable[[], object], *, graph: bool = True) -> tuple[float, str]:
        t0 = time.perf_counter()
        fn()  # also the first warm-up call
        if self.device == "cuda":
            torch.cuda.synchronize()
        probe_ms = (time.perf_counter() - t0) * 1e3
        iters = max(2, min(self.iters, int(self.target_s * 1e3 / max(probe_ms, 1e-3))))
        if self.device == "cuda" and graph:
            try:
                return time_graph(fn, warmup=1, iters=iters)["median_ms"], "graph"
            except Exception as exc:  # not capturable: eager instead
                print(f"      (eager timing: {type(exc).__name__}: {str(exc)[:120]})", flush=True)
                torch.cuda.synchronize()
        stats = time_cuda(fn, warmup=1, iters=iters, device=self.device)
        return stats["median_ms"], "eager"


def measure_ceiling(device: str, smoke: bool) -> float:
    """bf16 GEMM rate in TFLOP/s (8192³; 256³ in the smoke run)."""
    m = 256 if smoke else 8192
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    ms = time_cuda(lambda: a @ b, warmup=3, iters=10, device=device)["median_ms"]
    return 2.0 * m**3 / (ms * 1e-3) / 1e12


# ------------------------------------------------------------------------------ one case


class Run:
    def __init__(self, args: argparse.Namespace, cfg: DeepseekV41Config) -> None:
        """`cfg`: the tiny config for --smoke, else Flash (`main` picks it once)."""
        self.smoke = args.smoke
        self.device = "cpu" if args.smoke else "cuda"
        self.dtype = torch.bfloat16
        self.cfg = cfg
        if args.smoke:
            self.cases, self.layer_ids, self.cp_case = SMOKE_CASES, SMOKE_LAYERS, SMOKE_CP_CASE
        else:
            self.cases, self.layer_ids, self.cp_case = CASES, LAYERS, CP_CASE
        if args.layers:
            self.layer_ids = tuple(int(v) for v in args.layers.split(","))
        self.timer = Timer(self.device, args.iters, args.target_s)
        self.cp_repeats = args.cp_repeats
        self.sweep = args.sweep and not args.smoke
        self.budget = Budget(args.budget_s)
        self.quant: QuantMode = args.quant
        self.layers = build_layers(
            self.cfg, self.layer_ids, self.dtype, self.device, quant=self.quant
        )
        self.kept_bytes = 0  # bf16 copies of the fp8 projections (`--keep-bf16-weights`)
        if args.keep_bf16_weights:
            self.kept_bytes = sum(keep_dequantized_weights(a) for a in self.layers.values())
            print(f"kept bf16 copies of the layers' fp8 weights: {self.kept_bytes / 2**20:.1f} MiB")
        self.executors: dict[str, Executor] = {"serial": SERIAL}
        self.streams: StreamPool | None = None
        if self.device == "cuda":
            self.streams = StreamPool(
                lanes_of([a.schedule() for a in self.layers.values()]), torch.device("cuda")
            )
            self.executors["multistream"] = MultistreamExecutor(self.streams)
        self.flashmla = _has_flashmla()
        self.peer = args.peer and (self.flashmla or self.smoke)
        if args.peer and not self.peer:
            print("peer skipped: flash_mla does not import (install sgl-flash-mla 1.0.0)")
        self.ceiling = measure_ceiling(self.device, self.smoke)
        print(f"bf16 GEMM ceiling: {self.ceiling:.1f} TFLOP/s", flush=True)

    # -------------------------------------------------------------- per layer
    def layer_row(
        self, case: str, ctx: ForwardContext, x: torch.Tensor, layer: DeepseekV41Attention
    ) -> dict[str, Any]:
        role = layer.role
        prefix, tokens = self.cases[case]
        row: dict[str, Any] = dict(
            case=case, prefix=prefix, tokens=tokens, layer=layer.layer, role=role.name
        )
        record: dict[str, Any] = {}

        def record_index(lay: DeepseekV41Attention, st: PrepareState) -> None:
            record["idx"] = PrepareState(st.ctx, idx_q=st["idx_q"], idx_w=st["idx_w"])
            DeepseekV41Attention._logits_topk(lay, st)

        routed = layer_module.sparse_attention_cached

        def record_attention(*a: Any, **kw: Any) -> torch.Tensor:
            record["attn"], record["attn_kw"] = a, kw
            return routed(*a, **kw)

        with patched(
            layer,
            logits_topk=record_index if role.index_source else None,
            attention=record_attention,
        ):
            self.forward(layer, x, ctx)  # also leaves this layer's records for the later layers
        timed = self.executor_times(layer, x, ctx)
        name = min(timed, key=lambda k: timed[k][0])
        row["dsv4cp_ms"], row["dsv4cp_path"] = timed[name][0], f"{timed[name][1]} {name}"
        self.forward(layer, x, ctx)  # later layers read records made eagerly, not in a graph
        row["dsv4cp_indexer"] = "fused (layer)" if role.index_source else "-"
        row["dsv4cp_attention"] = _attention_backend(record["attn"][0])
        self.components(row, ctx, layer, record)
        if self.peer:
            self.peer_time(row, ctx, x, layer, record)
        run, flops = gemm_chain(layer, x)
        row["gemm_ms"] = self.timer(run)[0]
        row["gemm_tflops"] = flops / (row["gemm_ms"] * 1e-3) / 1e12
        work = row["attn_flops"] + row.get("idx_flops", 0.0)
        row["floor_ms"] = row["gemm_ms"] + work / (self.ceiling * 1e12) * 1e3
        row["dsv4cp_over_floor"] = row["dsv4cp_ms"] / row["floor_ms"]
        if "peer_ms" in row:
            row["dsv4cp_over_peer"] = row["dsv4cp_ms"] / row["peer_ms"]
            row["speedup_vs_peer"] = row["peer_ms"] / row["dsv4cp_ms"]
        return row

    def forward(
        self,
        layer: DeepseekV41Attention,
        x: torch.Tensor,
        ctx: ForwardContext,
        executor: Executor = SERIAL,
    ) -> torch.Tensor:
        """The layer's forward; the run's first layer starts from an empty `ctx.cross.attention`
        (in the model the forward's first layer numbers the window's rows; every call here
        does), the others find what the layers before them left, as in the model."""
        if layer.layer == self.layer_ids[0]:
            ctx.cross.attention = AttentionMemo()
        return layer.forward(x, ctx, executor)

    def components(
        self, row: dict[str, Any], ctx: ForwardContext, layer: DeepseekV41Attention, rec: dict
    ) -> None:
        cfg, role = layer.config, layer.role
        q, kv, idx, sink, scale = dense_attention_args(rec["attn"])
        valid = int((idx >= 0).sum().item())
        row["attn_keys_per_row"] = valid / max(1, idx.shape[0])
        row["attn_flops"] = 2.0 * layer.n_heads * (2 * layer.head_dim) * valid
        cached = rec["attn"]  # built afresh each call: not the workspace the next layer reuses
        cached_kw = {k: v for k, v in rec["attn_kw"].items() if k != "workspace_memo"}
        row["attn_layer_ms"] = self.timer(
            lambda: routing.sparse_attention_cached(*cached, **cached_kw)
        )[0]
        if not self.smoke:
            row["attn_triton_cached_ms"] = self.timer(lambda: _triton_cached(*cached))[0]
        attn_triton = routing.sparse_attention if self.smoke else _triton_attention
        row["attn_triton_ms"] = self.timer(lambda: attn_triton(q, kv, idx, sink, scale))[0]
        if self.flashmla:
            row["attn_flashmla_ms"] = self.timer(
                lambda: sglang_peer.flashmla_sparse_attention(q, kv, idx, sink, scale)
            )[0]
            row["triton_vs_flashmla"] = row["attn_flashmla_ms"] / row["attn_triton_ms"]
        if not role.index_source:
            return
        st = rec["idx"]
        r = role.ratio
        n_vis = ctx.local.n_visible(r)
        scored = n_vis.clamp(max=cfg.candidate_topk_blocks * cfg.candidate_block_size)
        n_eff = scored if role.candidate_consumer else n_vis
        row["idx_flops"] = 2.0 * cfg.index_n_heads * cfg.index_head_dim * float(n_eff.sum())
        saved = (dict(ctx.cross.topk), dict(ctx.cross.candidates))
        memo = dataclasses.replace(ctx.cross.attention)  # rows from dsv4cp's top-k, not the peer's
        fused = lambda: DeepseekV41Attention._logits_topk(layer, st)  # noqa: E731
        unfused_logits_topk(layer, st)
        want = ctx.cross.topk[r]
        fused()
        row["fused_rows_identical"] = float((ctx.cross.topk[r] == want).all(1).float().mean())
        row["idx_unfused_ms"] = self.timer(lambda: unfused_logits_topk(layer, st))[0]
        row["idx_layer_ms"] = row["idx_fused_ms"] = self.timer(fused)[0]
        if self.sweep:
            row["idx_fused_sweep"] = self.sweep_fused(ctx, layer, st)
        if self.peer:
            row["idx_peer_ms"] = self.timer(
                lambda: sglang_peer.peer_logits_topk(layer, st), graph=False
            )[0]
        ctx.cross.topk.update(saved[0])
        ctx.cross.candidates.update(saved[1])
        ctx.cross.attention = memo

    def sweep_fused(
        self, ctx: ForwardContext, layer: DeepseekV41Attention, st: PrepareState
    ) -> dict[str, float]:
        """The fused indexer's ms per (BLOCK_T, BLOCK_N, warps, stages) and buffer size."""
        from dsv4cp.kernels.indexer_topk import launch_mqa_topk

        cfg, role, r = layer.config, layer.role, layer.role.ratio
        args = (st["idx_q"], st["idx_w"], index_workspace(layer, ctx), ctx.local.n_visible(r))
        kw: dict[str, Any] = dict(
            k_start=ctx.workspace_start(r),
            width=max(ctx.meta.workspaces[r].max_entries, 1),
            block_size=cfg.candidate_block_size,
            quant=layer.quant,
        )
        if role.candidate_consumer:
            kw["block_ids"] = ctx.cross.candidates[r]
        elif role.candidate_source:
            kw["max_blocks"] = cfg.candidate_topk_blocks
        out: dict[str, float] = {}
        for config in FUSED_SWEEP:
            for cap in (None, 2048):
                try:
                    out[f"{config} cap={cap}"] = self.timer(
                        lambda c=config, cp=cap: launch_mqa_topk(
                            *args, cfg.index_topk, config=c, cap=cp, **kw
                        )
                    )[0]
                except Exception as exc:
                    print(f"      sweep {config} cap={cap}: {_err(exc)}", flush=True)
        return out

    def peer_time(
        self,
        row: dict[str, Any],
        ctx: ForwardContext,
        x: torch.Tensor,
        layer: DeepseekV41Attention,
        rec: dict[str, Any],
    ) -> None:
        saved = (dict(ctx.cross.topk), dict(ctx.cross.candidates))
        memo = dataclasses.replace(ctx.cross.attention)  # rows from dsv4cp's top-k, not the peer's
        dense_attention = (
            sglang_peer.flashmla_sparse_attention if self.flashmla else ops.sparse_attention
        )
        # the peer attends over its bf16 workspace, built (and timed) apart below
        dense = dense_attention_args(rec["attn"])

        def attention(*_: Any, **__: Any) -> torch.Tensor:
            return dense_attention(*dense)

        index = sglang_peer.peer_logits_topk if layer.role.index_source else None
        with patched(layer, logits_topk=index, attention=attention):
            row["peer_layer_ms"] = self.timer(lambda: self.forward(layer, x, ctx), graph=False)[0]
        ctx.cross.topk.update(saved[0])
        ctx.cross.candidates.update(saved[1])
        ctx.cross.attention = memo
        swa, comp = sglang_peer.workspace_rows(layer, ctx)
        cache, src = ctx.cache, layer.role.kv_source
        swa_pool = cache.swa[layer.layer]
        row["peer_workspace_ms"] = self.timer(lambda: swa_pool.index_select(0, swa))[0]
        if comp is not None and src is not None:
            comp_pool = cache.compressed[src]
            row["peer_workspace_ms"] += self.timer(lambda: comp_pool.index_select(0, comp))[0]
        row["peer_ms"] = row["peer_layer_ms"] + row["peer_workspace_ms"]

    # -------------------------------------------------------------- per case
    def case_rows(self, case: str, rows: list[dict[str, Any]], cp_rows: list[dict[str, Any]]):
        prefix, tokens = self.cases[case]
        print(f"case {case}: prefix {prefix}, {tokens} new tokens", flush=True)
        ctx = make_context(self.cfg, prefix, tokens, self.device, self.dtype, self.quant)
        x = torch.randn(tokens, self.cfg.hidden_size, device=self.device, dtype=self.dtype)
        cp1: dict[int, float] = {}
        for i in self.layer_ids:
            layer = self.layers[i]
            if self.budget.left() <= 0:
                rows.append(dict(case=case, layer=i, role=layer.role.name, error="time budget"))
                continue
            try:
                row = self.layer_row(case, ctx, x, layer)
                cp1[i] = row["dsv4cp_ms"]
                print("   ", _brief(row), flush=True)
            except Exception as exc:  # keep going: the other layers and cases still count
                traceback.print_exc()
                row = dict(case=case, layer=i, role=layer.role.name, error=_err(exc))
                _release(self.device)
            rows.append(row)
        if case == self.cp_case:
            for n in (2,) if self.smoke else CP_SIZES:
                self.cp_rank_rows(case, ctx, x, n, cp1, cp_rows)
        del ctx, x
        _release(self.device)

    def cp_rank_rows(
        self,
        case: str,
        ctx1: ForwardContext,
        x1: torch.Tensor,
        n: int,
        cp1: dict[int, float],
        out: list[dict[str, Any]],
    ) -> None:
        """Rank 0 of CP = n alone (its gathers tile its shard): compute only, one GPU, against
        (CP 1 time) / n. One layer's CP 1 graph time varied by up to 8 % between samples minutes
        apart on the H200 (docs/performance.md §14), as much as the targets' margins, so each
        repeat (`--cp-repeats`) first runs a CP 1 pass of its own, then the ranks; the CP 1 time
        is the mean of the first pass's sample and the repeats' (`cp1_samples_ms`), the rank
        time the median of the repeats' (`rank_samples_ms`), and each repeat's ratio (its rank
        over the mean of the first pass's and its own CP 1 sample) is kept with their min and
        max. The CP 1 passes run the layers in model order on the CP 1 context, so each layer
        reads what the CP 1 forwards of the layers before it wrote (the rank context shares the
        cache: a CP 1 sample taken between rank forwards would read the ranks' rows)."""
        try:
            ctx = ForwardContext.for_rank(ctx1.meta, ctx1.cache, SoloCPGroup(n))
            x = torch.randn(
                ctx.local_rows, self.cfg.hidden_size, device=self.device, dtype=self.dtype
            )
        except Exception as exc:
            traceback.print_exc()
            out.append(dict(case=case, cp=n, error=_err(exc)))
            return
        # per layer and repeat: (its CP 1 sample, rank ms, rank / its ideal, executors' ms)
        samples: dict[int, list[tuple[float, float, float, dict[str, float]]]] = {}
        errors: dict[int, str] = {}
        for rep in range(self.cp_repeats):
            now_ms: dict[int, float] = {}
            for i in self.layer_ids:  # this repeat's CP 1 pass
                if i in cp1 and i not in errors and self.budget.left() > 0:
                    try:
                        now_ms[i] = min(
                            self.times_between_forwards(self.layers[i], x1, ctx1).values()
                        )
                    except Exception as exc:
                        traceback.print_exc()
                        errors[i] = _err(exc)
                        _release(self.device)
            for i in self.layer_ids:
                if i not in now_ms or self.budget.left() <= 0:
                    continue
                try:
                    times = self.times_between_forwards(self.layers[i], x, ctx)
                except Exception as exc:
                    traceback.print_exc()
                    errors[i] = _err(exc)
                    _release(self.device)
                    continue
                best, now = min(times.values()), now_ms[i]
                ratio = best / ((now + cp1[i]) / 2 / n)  # over the first pass's and its sample
                samples.setdefault(i, []).append((now, best, ratio, times))
                print(
                    f"    CP {n} layer {i} (repeat {rep + 1}): {best:.3f} ms = "
                    f"{ratio:.3f}x ideal (CP 1 {cp1[i]:.3f} / "
                    f"{now:.3f} ms; {', '.join(f'{k} {v:.3f}' for k, v in times.items())})",
                    flush=True,
                )
        for i in self.layer_ids:
            layer = self.layers[i]
            row: dict[str, Any] = dict(case=case, cp=n, layer=i, role=layer.role.name)
            if i not in samples:
                row["error"] = errors.get(i) or ("no CP 1 time" if i not in cp1 else "time budget")
                out.append(row)
                continue
            got = samples[i]
            cp1_all = [cp1[i]] + [s[0] for s in got]
            ranks = [s[1] for s in got]
            mean = statistics.fmean(cp1_all)
            rank = statistics.median(ranks)
            per_repeat = [s[2] for s in got]
            last = got[-1][3]
            row.update(rank_ms=rank, cp1_ms=mean, ideal_ms=mean / n)
            row["rank_over_ideal"] = rank / row["ideal_ms"]
            row["rank_over_ideal_min"], row["rank_over_ideal_max"] = (
                min(per_repeat),
                max(per_repeat),
            )
            row["rank_over_ideal_repeats"] = per_repeat
            row["cp1_samples_ms"], row["rank_samples_ms"] = cp1_all, ranks
            row["rank_executor"] = min(last, key=lambda k: last[k])
            row["rank_ms_by_executor"] = [s[3] for s in got]
            auto = auto_executor(layer.role, ctx.local_rows, self.streams)
            if auto in last:
                row["auto_executor"] = auto
                row["auto_rank_ms"] = statistics.median(s[3][auto] for s in got)
                row["auto_rank_over_ideal"] = row["auto_rank_ms"] / row["ideal_ms"]
            row["replicated"] = _replicated(layer)
            print(
                f"    CP {n} layer {i}: {rank:.3f} ms = {row['rank_over_ideal']:.3f}x ideal "
                f"({len(got)} repeat(s): {row['rank_over_ideal_min']:.3f}–"
                f"{row['rank_over_ideal_max']:.3f}x)",
                flush=True,
            )
            out.append(row)

    def executor_times(
        self, layer: DeepseekV41Attention, x: torch.Tensor, ctx: ForwardContext
    ) -> dict[str, tuple[float, str]]:
        """Each executor's time of the layer's forward, and how it was timed (graph / eager)."""
        return {
            name: self.timer(lambda ex=ex: self.forward(layer, x, ctx, ex))
            for name, ex in self.executors.items()
        }

    def times_between_forwards(
        self, layer: DeepseekV41Attention, x: torch.Tensor, ctx: ForwardContext
    ) -> dict[str, float]:
        """`executor_times` (ms) between eager forwards that leave the layer's records for the
        later layers."""
        self.forward(layer, x, ctx)
        times = {name: ms for name, (ms, _) in self.executor_times(layer, x, ctx).items()}
        self.forward(layer, x, ctx)  # eager records for the later layers
        return times


def _triton_cached(*a: Any) -> torch.Tensor:
    from dsv4cp.kernels.attention import sparse_attention_cached

    return sparse_attention_cached(*a)


def _attention_backend(q: torch.Tensor) -> str:
    if not q.is_cuda:
        return "ops twin (CPU)"
    from dsv4cp.kernels.flashmla import sparse_attention_cached_backend

    return sparse_attention_cached_backend(q)


def _triton_attention(*a: Any) -> torch.Tensor:
    from dsv4cp.kernels.attention import launch_sparse_attention

    return launch_sparse_attention(*a)


def _has_flashmla() -> bool:
    try:
        import flash_mla  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def _replicated(layer: DeepseekV41Attention) -> str:
    parts = ["SWA store of all T rows"]
    if layer.role.owns_compressor:
        parts.append("compressor + index keys of all T rows, index-K workspace of the context")
    if layer.role.index_source:
        parts.append("(indexer: local queries x whole context, not replicated)")
    return "; ".join(parts)


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def _release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _brief(row: dict[str, Any]) -> str:
    keys = ("dsv4cp_ms", "peer_ms", "floor_ms", "speedup_vs_peer", "dsv4cp_over_floor")
    vals = " ".join(f"{k}={row[k]:.3f}" for k in keys if isinstance(row.get(k), float))
    return f"layer {row['layer']} {row['role']}: {vals}"


def auto_executor(role: LayerRole, local_rows: int, streams: StreamPool | None) -> str:
    """The executor ("serial" / "multistream") the `auto` policy (with $DSV4CP_MULTISTREAM*)
    runs for `role` at `local_rows` rows inside CUDA graphs: `ExecutorFactory.choose`'s pick
    (no streams, as on the CPU: serial)."""
    factory = ExecutorFactory(MultistreamPolicy.from_env("auto"), streams)
    chosen = factory.choose(local_rows, graphs=True).for_role(role)
    return "multistream" if isinstance(chosen, MultistreamExecutor) else "serial"


def layer_list_problem(cfg: DeepseekV41Config, layers: str) -> str | None:
    """Why a `--layers` list cannot run, or None: ids of the config, each once, in model order,
    and every layer whose top-k or candidates another layer publishes listed after that layer
    (the run passes them on through the context, as the model's forward does)."""
    try:
        ids = [int(v) for v in layers.split(",")]
    except ValueError:
        return "a comma list of layer ids"
    bad = [i for i in ids if not 0 <= i < cfg.num_hidden_layers]
    if bad:
        return f"{bad} are not layers of the config (0..{cfg.num_hidden_layers - 1})"
    if ids != sorted(set(ids)):
        return "list each layer once, in model order"
    for i in ids:
        role = cfg.layer_role(i)
        needs = {role.topk_from} if role.topk_from not in (None, i) else set()
        if role.candidate_consumer:
            needs.add(cfg.candidate_source_layer_id)
        missing = sorted(n for n in needs if n not in ids)  # type: ignore[type-var]
        if missing:
            return f"layer {i} reads what layer(s) {missing} publish; list them too"
    return None


# ------------------------------------------------------------------------------ targets


def targets(rows: list[dict[str, Any]], cp_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 15's targets against this run: value, goal, met, and by how much if not."""
    out: list[dict[str, Any]] = []

    def add(what: str, case: str, role: str, value: float | None, goal: float, low: bool) -> None:
        if value is None:
            return
        met = value >= goal if low else value <= goal
        miss = None if met else (goal / value if low else value / goal)
        out.append(
            dict(target=what, case=case, role=role, value=value, goal=goal, met=met, missed_by=miss)
        )

    for r in rows:
        if "error" in r:
            continue
        role, case = f"{r['role']} (layer {r['layer']})", r["case"]
        if role.startswith("r2+kv_source+index_source") and case in ("cold16k", "cold64k"):
            goal = 3.5 if case == "cold16k" else 8.0
            add("index source vs peer (x)", case, role, r.get("speedup_vs_peer"), goal, True)
        if case.startswith("chunk16k"):
            add("each role vs peer (x)", case, role, r.get("speedup_vs_peer"), 4.0, True)
        if case in ("cold16k", "cold64k"):
            add("dsv4cp / floor", case, role, r.get("dsv4cp_over_floor"), 1.5, False)
        add("Triton / FlashMLA speed", case, role, r.get("triton_vs_flashmla"), 0.8, True)
    for r in cp_rows:
        if "rank_over_ideal" in r:
            goal = 1.12 if r["cp"] == 4 else 1.15
            add(
                f"CP {r['cp']} rank / ideal ({r.get('auto_executor', 'best')})",
                r["case"],
                f"{r['role']} (layer {r['layer']})",
                r.get("auto_rank_over_ideal", r["rank_over_ideal"]),
                goal,
                False,
            )
    return out


# ------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="", help=f"comma list of {', '.join(CASES)} (default all)")
    ap.add_argument("--layers", default="", help=f"comma list of layer ids (default {LAYERS})")
    ap.add_argument("--iters", type=int, default=10, help="timed calls at most per measurement")
    ap.add_argument("--target-s", type=float, default=0.5, help="seconds per measurement, about")
    ap.add_argument("--budget-s", type=float, default=280.0, help="stop starting work after this")
    ap.add_argument(
        "--quant", choices=("qat", "none"), default="qat", help="numerics and cache formats"
    )
    ap.add_argument("--sweep", action="store_true", help="also time the fused kernel's configs")
    ap.add_argument("--no-peer", dest="peer", action="store_false")
    ap.add_argument("--no-cp", dest="cp", action="store_false")
    ap.add_argument(
        "--keep-bf16-weights",
        action="store_true",
        help="hold bf16 copies of the fp8 projections (no per-call dequantization; both paths)",
    )
    ap.add_argument(
        "--cp-repeats",
        type=int,
        default=1,
        help="CP rows: repeats of (a CP 1 pass, then the ranks) per CP size; median and spread",
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny config, torch peer parts")
    ap.add_argument("--out", default="out/layer_peer.json")
    args = ap.parse_args(argv)
    if args.cp_repeats < 1:
        print(f"layer_peer: --cp-repeats must be ≥ 1, got {args.cp_repeats}", file=sys.stderr)
        return 2
    if not args.smoke and not torch.cuda.is_available():
        print("layer_peer: needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    cfg = DeepseekV41Config.tiny() if args.smoke else DeepseekV41Config.flash()
    problem = layer_list_problem(cfg, args.layers) if args.layers else None
    if problem:
        print(f"layer_peer: --layers {args.layers}: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # backend choices
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    cp_rows: list[dict[str, Any]] = []
    run: Run | None = None
    try:
        run = Run(args, cfg)
        names = [c for c in args.cases.split(",") if c] or list(run.cases)
        unknown = [c for c in names if c not in run.cases]
        if unknown:
            print(f"layer_peer: unknown cases {unknown}; known: {list(run.cases)}", file=sys.stderr)
            return 2
        if not args.cp:
            run.cp_case = ""
        for case in names:
            if run.budget.left() <= 0:
                rows.append(dict(case=case, error="time budget"))
                continue
            try:
                run.case_rows(case, rows, cp_rows)
            except Exception as exc:  # the case's set-up failed (memory?): record, go on
                traceback.print_exc()
                rows.append(dict(case=case, error=_err(exc)))
                _release(run.device)
    finally:
        report(args, run, rows, cp_rows)
    return 0


def report(
    args: argparse.Namespace,
    run: Run | None,
    rows: list[dict[str, Any]],
    cp_rows: list[dict[str, Any]],
) -> None:
    cols = [
        "case", "layer", "role", "dsv4cp_ms", "peer_ms", "floor_ms", "speedup_vs_peer",
        "dsv4cp_over_floor", "gemm_ms", "idx_layer_ms", "idx_unfused_ms", "idx_peer_ms",
        "attn_layer_ms", "attn_triton_cached_ms", "attn_triton_ms", "attn_flashmla_ms",
        "triton_vs_flashmla", "dsv4cp_path", "error",
    ]  # fmt: skip
    dims = "V4.1-Flash dims (d 5120, 64 heads x 512, index 32 x 128, top-k 512, window 128)"
    gpu = device_info().get("gpu_name", "cpu")
    table = Table(
        cols,
        title=f"layer_peer: {'tiny config (smoke)' if args.smoke else dims}, bf16, one request; "
        f"ms per layer forward on {gpu}",
    )
    for r in rows:
        table.add(r)
    table.print()
    if cp_rows:
        cp_table = Table(
            [
                "case",
                "cp",
                "layer",
                "role",
                "rank_ms",
                "ideal_ms",
                "rank_over_ideal",
                "rank_over_ideal_min",
                "rank_over_ideal_max",
                "auto_executor",
                "auto_rank_over_ideal",
                "error",
            ],
            title="CP per-rank time (rank 0 alone, gathers tile its shard; compute only)",
        )
        for r in cp_rows:
            cp_table.add(r)
        cp_table.print()
    mix = [] if run is None or not cp_rows else forward_mix.forward_mix(run.cfg, cp_rows)
    if mix:
        forward_mix.table(mix, "tiny config" if args.smoke else "V4.1-Flash").print()
    goals = targets(rows, cp_rows)
    if goals:
        t = Table(["target", "case", "role", "value", "goal", "met", "missed_by"], title="targets")
        for g in goals:
            t.add(g)
        t.print()
    payload = {
        "benchmark": "layer_peer",
        "dtype": "bfloat16",
        "config": "tiny" if args.smoke else "flash",
        "shapes": dims if not args.smoke else "tiny",
        "gpu": gpu,
        "ceiling_tflops": None if run is None else run.ceiling,
        "flashmla": None if run is None else run.flashmla,
        "quant": None if run is None else run.quant,
        "fused_indexer": "layer",
        "kept_bf16_weight_bytes": None if run is None else run.kept_bytes,
        "rows": rows,
        "cp_rows": cp_rows,
        "forward_mix": mix,
        "targets": goals,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    write_json(args.out, payload)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
