"""Serial vs multistream forward prepare of V4.1-Flash layers, eager and inside a CUDA graph.

One run measures, per layer role and local token count: the prepare time (the layer's schedule,
qkv_a up to and including logits/top-k) for the serial and the multistream executor, eagerly and
as a captured CUDA graph replay, the overlap metric (fraction of the prepare window in which ≥ 2
streams run kernels, from a torch.profiler trace of graph replays) and the ratios. CP = 1 (one
GPU): the gathers are no-ops here; docs/performance.md says what that leaves out.

    PYTHONPATH=python python -m benchmarks.prepare_overlap --tokens 512,1024,2048,4096,8192 \
        --out out/prep.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from benchmarks.benchutil import Table, device_info, time_cuda, time_graph, write_json
from dsv4cp.batch import PrefillBatch, RequestSlice, build_metadata
from dsv4cp.cache import KVCache
from dsv4cp.config import DeepseekV41Config
from dsv4cp.context import ForwardContext
from dsv4cp.cp.group import SingleCPGroup
from dsv4cp.executors import SERIAL, Executor, ExecutorFactory, MultistreamExecutor, StreamPool
from dsv4cp.layers.attention import DeepseekV41Attention
from dsv4cp.model import init_random_
from dsv4cp.observe.profiling import capture_trace
from dsv4cp.observe.timeline import overlap_fraction, plot_timeline
from dsv4cp.policy import MultistreamPolicy
from dsv4cp.schedule import lanes_of

LAYERS = (2, 3, 20, 21, 24)  # r2 kv+index source, r2 reuse, r1 candidate source, r1 reuse, consumer


def build_layers(cfg: DeepseekV41Config, ids: tuple[int, ...], dtype: torch.dtype):
    layers = {i: DeepseekV41Attention(cfg, i, dtype=dtype, device="cuda") for i in ids}
    # One CUDA generator across the layers, by checkpoint name (the model's own init).
    weights = {
        f"layers.{i}.attn.{n}": t
        for i, a in layers.items()
        for n, t in a.checkpoint_weights().items()
    }
    init_random_(weights, cfg, 0, device="cuda")
    return layers


def make_ctx(cfg: DeepseekV41Config, tokens: int, dtype: torch.dtype) -> ForwardContext:
    slots = tokens + 64
    cache = KVCache(cfg, slots, max_requests=2, max_context=tokens + 16, device="cuda", dtype=dtype)
    cache.req_to_token[0, :tokens] = torch.arange(1, tokens + 1, device="cuda")
    batch = PrefillBatch((RequestSlice("r", 0, 0, tuple(range(tokens))),))
    meta = build_metadata(batch, cache.req_to_token, list(range(1, tokens + 1)), (1, 2))
    return ForwardContext.for_rank(meta, cache, SingleCPGroup())


def measure(
    attn: DeepseekV41Attention,
    ctx: ForwardContext,
    x: torch.Tensor,
    iters: int,
    png: str | None,
    executors: dict[bool, Executor],
) -> dict:
    def run(ms: bool) -> None:
        attn.prepare(x, ctx, executors[ms])

    res = {}
    for ms in (False, True):
        key = "multistream" if ms else "serial"
        res[f"eager_{key}"] = time_cuda(lambda ms=ms: run(ms), warmup=3, iters=iters)["median_ms"]
        res[f"graph_{key}"] = time_graph(lambda ms=ms: run(ms), warmup=2, iters=iters)["median_ms"]
    overlap = {}
    for ms in (False, True):
        graph = torch.cuda.CUDAGraph()
        for _ in range(2):
            run(ms)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            run(ms)
        tokens = x.shape[0]
        trace = capture_trace(graph.replay, path=f"/tmp/prep_{tokens}_{attn.layer}_{int(ms)}.json")
        kernels = trace.kernels()
        overlap["multistream" if ms else "serial"] = overlap_fraction(kernels)
        if ms and png:
            plot_timeline(
                kernels,
                png,
                highlight=("nccl",),
                title=f"layer {attn.layer} ({attn.role.name}) prepare, {tokens} tokens, "
                "multistream, CUDA graph replay",
            )
        del graph
    row = dict(
        layer=attn.layer,
        role=attn.role.name,
        tokens=x.shape[0],
        **res,
        overlap_serial=overlap["serial"],
        overlap_multistream=overlap["multistream"],
    )
    row["eager_ratio"] = res["eager_multistream"] / res["eager_serial"]
    row["graph_ratio"] = res["graph_multistream"] / res["graph_serial"]
    # The runner's decision with multistream="auto" (the policy's defaults).
    factory = ExecutorFactory(MultistreamPolicy(), executors[True].streams)
    for mode in ("eager", "graph"):
        chosen = factory.choose(x.shape[0], graphs=mode == "graph").for_role(attn.role)
        use = isinstance(chosen, MultistreamExecutor)
        picked = res[f"{mode}_{'multistream' if use else 'serial'}"]
        best = min(res[f"{mode}_serial"], res[f"{mode}_multistream"])
        row[f"policy_{mode}"] = "multistream" if use else "serial"
        # Within 2% (timing noise) of the faster executor counts as not slower.
        row[f"policy_{mode}_ok"] = picked <= best * 1.02
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="512,1024,2048,4096,8192")
    ap.add_argument("--layers", default=",".join(map(str, LAYERS)))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="out/prepare_overlap.json")
    ap.add_argument("--png", default=None, help="timeline PNG of one multistream graph replay")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("prepare_overlap: needs a CUDA GPU", file=sys.stderr)
        return 2
    cfg = DeepseekV41Config.flash(quantization=None)  # dense bf16 weights, random
    dtype = torch.bfloat16
    ids = tuple(int(v) for v in args.layers.split(","))
    layers = build_layers(cfg, ids, dtype)
    streams = StreamPool(lanes_of([a.schedule() for a in layers.values()]), torch.device("cuda"))
    executors: dict[bool, Executor] = {False: SERIAL, True: MultistreamExecutor(streams)}
    table = Table(title="forward prepare, V4.1-Flash dims, bf16, CP=1, one request, prefix 0")
    rows = []
    png_done = False
    toks = [int(v) for v in args.tokens.split(",")]
    for tokens in toks:
        ctx = make_ctx(cfg, tokens, dtype)
        x = torch.randn(tokens, cfg.hidden_size, device="cuda", dtype=dtype)
        for i in sorted(ids):  # populate cross-layer state (index-K ws, top-k, candidates)
            layers[i].prepare(x, ctx)
        for i in ids:
            want_png = args.png and not png_done and (tokens == 2048 or tokens == toks[-1])
            row = measure(layers[i], ctx, x, args.iters, args.png if want_png else None, executors)
            png_done = png_done or bool(want_png)
            rows.append(row)
            table.add(row)
            print(f"  layer {i} tokens {tokens}: graph ratio {row['graph_ratio']:.3f}", flush=True)
        del ctx
        torch.cuda.empty_cache()
    table.print()
    ok = sum(r["policy_eager_ok"] and r["policy_graph_ok"] for r in rows)
    print(f"policy picks a path no slower than the other (within 2%) in {ok}/{len(rows)} rows")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    write_json(
        args.out,
        {
            "benchmark": "prepare_overlap",
            "dtype": "bfloat16",
            "cp": 1,
            "config": "flash",
            "gpu": device_info().get("gpu_name"),
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
