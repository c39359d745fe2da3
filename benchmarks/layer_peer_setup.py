"""The pieces `benchmarks/layer_peer.py` times, and their set-up: the cases and layers, the
layers with random weights, a context over caches filled with random values, the layer's parts
timed apart (the unfused index node, the dense attention inputs, the GEMM chain, the fused
indexer's config sweep), the patch points that swap the index node or sparse attention, the
timer and the bf16 GEMM ceiling."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.benchutil import time_cuda, time_graph
from dsv4cp import ops, routing
from dsv4cp.batch import PrefillBatch, RequestSlice, build_metadata
from dsv4cp.cache import KVCache
from dsv4cp.config import DeepseekV41Config
from dsv4cp.context import ForwardContext
from dsv4cp.cp.group import SingleCPGroup
from dsv4cp.layers import attention as layer_module
from dsv4cp.layers.attention import DeepseekV41Attention
from dsv4cp.model import init_random_
from dsv4cp.ops.quant import QuantMode
from dsv4cp.schedule import PrepareState

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
    """The seconds of `--budget-s` left."""

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
            "update benchmarks/layer_peer_setup.py's patch points"
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


def sweep_fused(
    timer: Timer, ctx: ForwardContext, layer: DeepseekV41Attention, st: PrepareState
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
                out[f"{config} cap={cap}"] = timer(
                    lambda c=config, cp=cap: launch_mqa_topk(
                        *args, cfg.index_topk, config=c, cap=cp, **kw
                    )
                )[0]
            except Exception as exc:
                print(f"      sweep {config} cap={cap}: {error_text(exc)}", flush=True)
    return out


def triton_cached(*a: Any) -> torch.Tensor:
    """The Triton kernel on the caches (`kernels/attention.sparse_attention_cached`)."""
    from dsv4cp.kernels.attention import sparse_attention_cached

    return sparse_attention_cached(*a)


def triton_over_workspace(*a: Any, **kw: Any) -> torch.Tensor:
    """The portable path where neither FlashMLA nor Gluon runs (`kernels/flashmla`, "Triton
    kernel over a workspace"): the rows decoded once into a workspace (its build timed with
    it), then the Triton cached kernel's math over it — against the same kernel decoding on
    load (`attn_triton_cached_ms`, docs/performance.md §25)."""
    from dsv4cp.kernels import attention_workspace, flashmla

    q, win = a[0], a[2]
    quant = a[9] if len(a) > 9 else "none"
    attend = flashmla.triton_over_workspace(win.shape[1], quant)
    return attention_workspace.over_workspace(attend, q.dtype, *a[:9], **kw)


def attention_backend(q: torch.Tensor) -> str:
    """Which kernel the routed sparse attention runs for `q` (named in the rows)."""
    if not q.is_cuda:
        return "ops twin (CPU)"
    from dsv4cp.kernels.flashmla import sparse_attention_cached_backend

    return sparse_attention_cached_backend(q)


def triton_attention(*a: Any) -> torch.Tensor:
    """The dense Triton kernel on pre-decoded rows (`launch_sparse_attention`)."""
    from dsv4cp.kernels.attention import launch_sparse_attention

    return launch_sparse_attention(*a)


def has_flashmla() -> bool:
    """Whether `flash_mla` imports and a GPU is there (the peer and FlashMLA timings)."""
    try:
        import flash_mla  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


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


def error_text(exc: BaseException) -> str:
    """An error as recorded in a row: its type and the first 300 characters."""
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def release_memory(device: str) -> None:
    """Frees what a failed or finished case left (garbage, the CUDA cache)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
