"""Memory of a long request's chunk through the V4.1-Flash attention layers (quantized caches).

Builds the attention layers of `DeepseekV41Config.flash()` (random weights, fp8 storage, quant
"qat"), a `KVCache` in the qat formats with an SWA window pool, fills the caches as if a prefix of
`--context` − `--chunk` tokens had been prefilled (the allocator walks the prefix chunk by chunk,
so old SWA pages are handed back; the compressed and index rows are random encoded keys), then
runs one chunk of `--chunk` new tokens through every layer (each layer on the same random input
rows, cross-layer top-k and candidates flowing as in the model). It reports the bytes of every
cache kind beside `cache_bytes`' plan, the weights, and the peak memory of the forward.

    PYTHONPATH=python python -m benchmarks.cache_memory --context 1M --chunk 16K \
        --out out/cache_memory.json
    PYTHONPATH=python python -m benchmarks.cache_memory --smoke      # CPU, tiny dims

Without `--smoke` it needs CUDA.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

import torch

from benchmarks.benchutil import Table, device_info, write_json
from dsv4cp.batch import PrefillBatch, RequestSlice, build_metadata
from dsv4cp.cache import KVCache, PagedAllocator, cache_bytes
from dsv4cp.config import DeepseekV41Config
from dsv4cp.context import ForwardContext
from dsv4cp.cp.group import SingleCPGroup
from dsv4cp.layers.attention import DeepseekV41Attention
from dsv4cp.layers.linear import Linear
from dsv4cp.model import init_random_

GIB = 2**30


def _count(text: str) -> int:
    t = text.strip().lower()
    mult = {"k": 1 << 10, "m": 1 << 20}.get(t[-1:], 1)
    return int(t[:-1] if mult > 1 else t) * mult


def build_layers(
    cfg: DeepseekV41Config, n: int, dtype: torch.dtype, device: str
) -> list[DeepseekV41Attention]:
    """Layers 0…n−1 in qat with random weights in the checkpoint's storage (Flash: fp8 with
    block scales, so the weights take what a released checkpoint takes): dense weights as the
    model's init; fp8 ones N(0, 1) codes with the power-of-two scale nearest 1/√fan_in."""
    layers = [
        DeepseekV41Attention(cfg, i, dtype=dtype, device=device, quant="qat") for i in range(n)
    ]
    fp8 = [m for a in layers for m in a.modules() if isinstance(m, Linear) and m.scale is not None]
    dense = {
        f"layers.{a.layer}.attn.{name}": t
        for a in layers
        for name, t in a.checkpoint_weights().items()
        if t.dtype != torch.float8_e4m3fn and not name.endswith(".scale")
    }
    init_random_(dense, cfg, 0, device=device)
    g = torch.Generator(device=device).manual_seed(1)
    for m in fp8:
        assert m.scale is not None
        codes = torch.randn(m.weight.shape, generator=g, device=device)
        m.weight.copy_(codes.to(m.weight.dtype))
        m.scale.view(torch.uint8).fill_(127 + round(-0.5 * math.log2(m.in_features)))
    return layers


def _fill_random_rows(cache: KVCache, seed: int, rows_per_step: int = 1 << 16) -> None:
    """Every row of every pool: random keys in the cache's format (decoded values realistic)."""
    g = torch.Generator(device=cache.device).manual_seed(seed)
    pools = [("swa", t) for t in cache.swa.values()]
    pools += [("compressed", t) for t in cache.compressed.values()]
    pools += [("index", t) for t in cache.index.values()]
    dims = cache.dims()
    for kind, pool in pools:
        for a in range(0, pool.shape[0], rows_per_step):
            b = min(pool.shape[0], a + rows_per_step)
            x = torch.randn(b - a, dims[kind], generator=g, device=cache.device)
            pool[a:b] = cache.encode(kind, x.to(cache.dtype))  # type: ignore[arg-type]
    for t in (*cache.pair_kv.values(), *cache.pair_gate.values()):
        t.normal_(generator=g)


def prefill_prefix(alloc: PagedAllocator, rid: str, tokens: int, step: int) -> None:
    """Reserve and commit the prefix's slots chunk by chunk (no forward), as a chunked prefill
    would: each commit hands back the SWA pages older than the window."""
    done = 0
    while done < tokens:
        n = min(step, tokens - done)
        res = alloc.reserve(rid, n)
        alloc.write_table(res)
        alloc.commit(res)
        done += n


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("cache_memory: needs CUDA (or --smoke for the CPU at tiny dims)")
    cfg = DeepseekV41Config.tiny() if args.smoke else DeepseekV41Config.flash()
    context = _count(args.context or ("512" if args.smoke else "1M"))
    chunk = _count(args.chunk or ("64" if args.smoke else "16K"))
    if not 0 < chunk <= context:
        raise SystemExit(f"cache_memory: need 0 < chunk ({chunk}) <= context ({context})")
    n_layers = args.layers or cfg.num_hidden_layers
    page, dtype = args.page_size, torch.bfloat16
    prefix = context - chunk
    pages = -(-context // page)
    mem0 = torch.cuda.memory_allocated() if device == "cuda" else 0

    t0 = time.perf_counter()
    layers = build_layers(cfg, n_layers, dtype, device)
    weight_bytes = sum(
        t.numel() * t.element_size() for a in layers for t in (*a.parameters(), *a.buffers())
    )
    window_rows = cfg.sliding_window + chunk + 2 * page  # the window and one chunk in flight
    cache = KVCache(
        cfg,
        (pages + 1) * page,
        quant="qat",
        window_slots=window_rows,
        max_requests=1,
        max_context=context,
        page_size=page,
        device=device,
        dtype=dtype,
    )
    alloc = PagedAllocator(cache)
    _fill_random_rows(cache, seed=1)
    prefill_prefix(alloc, "r", prefix, chunk)
    setup_s = time.perf_counter() - t0

    g = torch.Generator(device=device).manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size, (chunk,), generator=g, device=device).tolist()
    res = alloc.reserve("r", chunk)
    alloc.write_table(res)
    batch = PrefillBatch((RequestSlice("r", res.row, res.start, tuple(ids)),))
    ratios = sorted({r for r in cfg.layer_ratios if r})
    meta = build_metadata(batch, cache.req_to_token, res.slots, ratios)
    ctx = ForwardContext.for_rank(meta, cache, SingleCPGroup())
    x = torch.randn(chunk, cfg.hidden_size, generator=g, device=device).to(dtype) * 0.1
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if device == "cuda" else 0
    times = []
    with torch.inference_mode():
        for attn in layers:
            t1 = time.perf_counter()
            y = attn(x, ctx)
            _sync(device)
            times.append(time.perf_counter() - t1)
            del y
    alloc.commit(res)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    held = cache.nbytes_by_kind()
    plan = cache_bytes(cfg, context, page_size=page, dtype=dtype)
    total = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else None
    return {
        "config": "tiny" if args.smoke else "flash",
        "device": device,
        "context_tokens": context,
        "chunk_tokens": chunk,
        "layers": n_layers,
        "page_size": page,
        "quant": "qat",
        "dtype": str(dtype),
        "cache_bytes_allocated": held,
        "cache_bytes_plan": plan.by_kind,
        "cache_plan_bytes_per_token": plan.per_token,
        "cache_allocated_bytes_per_token": sum(held.values()) / context,
        "swa_pages_held_after": alloc.swa_pages_held("r"),
        "weight_bytes": weight_bytes,
        "before_forward_bytes": before - mem0 if device == "cuda" else None,
        "peak_bytes": peak - mem0 if peak is not None else None,
        "forward_peak_over_start_bytes": None if peak is None else peak - before,
        "device_total_bytes": total,
        "fits": None if peak is None or total is None else peak < total,
        "setup_s": setup_s,
        "layer_s": times,
        "forward_s": sum(times),
    }


def report(result: dict[str, Any]) -> None:
    tab = Table(["what", "GiB", "B/token"], formats={"GiB": "{:.3f}", "B/token": "{:.1f}"})
    n = result["context_tokens"]
    for kind, b in result["cache_bytes_allocated"].items():
        plan = result["cache_bytes_plan"].get(kind, 0)
        tab.add(
            what=f"cache {kind} (plan {plan / n:.1f} B/token)", GiB=b / GIB, **{"B/token": b / n}
        )
    total = sum(result["cache_bytes_allocated"].values())
    tab.add(what="cache, all kinds", GiB=total / GIB, **{"B/token": total / n})
    tab.add(what="weights (attention layers)", GiB=result["weight_bytes"] / GIB)
    for key, name in (
        ("before_forward_bytes", "allocated before the chunk"),
        ("forward_peak_over_start_bytes", "chunk forward: peak over that"),
        ("peak_bytes", "peak"),
        ("device_total_bytes", "device memory"),
    ):
        if result[key] is not None:
            tab.add(what=name, GiB=result[key] / GIB)
    tab.title = (
        f"{result['config']}: a {result['chunk_tokens']}-token chunk at {n} tokens of context, "
        f"{result['layers']} attention layers, qat, page {result['page_size']}, "
        f"{result['device']}; forward {result['forward_s']:.2f} s"
    )
    tab.print()
    if result["fits"] is not None:
        print(f"fits one GPU: {result['fits']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", default=None, help="request tokens incl. the chunk (1M)")
    p.add_argument("--chunk", default=None, help="new tokens of the measured chunk (16K)")
    p.add_argument("--layers", type=int, default=0, help="first N layers (default all)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny config, small sizes")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    args = p.parse_args(argv)
    print(device_info().get("gpu_name", "cpu"), file=sys.stderr)
    result = run(args)
    report(result)
    if args.out:
        write_json(args.out, {"cache_memory": result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
