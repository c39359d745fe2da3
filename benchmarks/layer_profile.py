"""Where one V4.1-Flash attention layer's time goes: the top CUDA kernels of its eager forward.

The layers and context of `layer_peer_setup.py` (random weights, bf16, `--quant` numerics, one
request, `--tokens` new tokens after a cached `--prefix`), each layer profiled alone after
warm-up; prints a torch.profiler table per layer and writes the top kernels as JSON.

`--cp 1,4`: each CP size's rank 0 in turn (`SoloCPGroup`: one GPU, its gathers tile its own
shard; compute only, as layer_peer's CP rows), and for CP > 1 a table per layer of each stage's
CUDA time against CP 1's / N: where the rank's time exceeds the ideal split.

    PYTHONPATH=python python -m benchmarks.layer_profile --tokens 16384 --layers 0,2 \
        --out out/layer_profile.json
    PYTHONPATH=python python -m benchmarks.layer_profile --prefix 114688 --layers 2 --cp 1,4
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.benchutil import finish
from benchmarks.layer_peer_setup import build_layers, layer_list_problem, make_context
from benchmarks.prefill import SoloCPGroup
from benchmarks.profile_stages import by_stage
from dsv4cp.config import DeepseekV41Config
from dsv4cp.context import AttentionMemo, ForwardContext
from dsv4cp.layers.linear import keep_dequantized_weights

Stages = dict[str, list[dict[str, object]]]


def _stage_totals(stages: Stages) -> dict[str, float]:
    return {where: float(kernels[0]["cuda_ms"]) for where, kernels in stages.items()}  # type: ignore[arg-type]


def _print_cp_excess(layer: int, n: int, cp1: Stages, rank: Stages) -> list[dict[str, object]]:
    """Per stage: CP 1's ms, its ideal share (/ n), the rank's ms and the excess over the share."""
    one, got = _stage_totals(cp1), _stage_totals(rank)
    rows = []
    for where in sorted(set(one) | set(got), key=lambda w: -got.get(w, 0.0)):
        ideal = one.get(where, 0.0) / n
        rank_ms = got.get(where, 0.0)
        rows.append({"stage": where, "cp1_ms": one.get(where, 0.0), "ideal_ms": ideal,
                     "rank_ms": rank_ms, "excess_ms": rank_ms - ideal})  # fmt: skip
    print(f"layer {layer}: CP {n} rank 0 by stage against CP 1 / {n} (ms)")
    print(f"  {'stage':32} {'cp1':>9} {'cp1/n':>9} {'rank':>9} {'excess':>9}")
    for r in rows:
        print(f"  {str(r['stage'])[:32]:32} {r['cp1_ms']:9.3f} {r['ideal_ms']:9.3f} "
              f"{r['rank_ms']:9.3f} {r['excess_ms']:9.3f}")  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384, help="new tokens (all CP ranks)")
    ap.add_argument("--prefix", type=int, default=0, help="cached tokens before them")
    ap.add_argument("--cp", default="1", help="comma list of CP sizes (rank 0 profiled)")
    ap.add_argument("--layers", default="0,2", help="comma list of Flash layer ids")
    ap.add_argument("--quant", choices=["qat", "none"], default="qat")
    ap.add_argument(
        "--keep-bf16-weights", action="store_true", help="bf16 copies of the fp8 projections"
    )
    ap.add_argument("--rows", type=int, default=15)
    ap.add_argument("--stage-rows", type=int, default=6, help="kernels listed per stage")
    ap.add_argument("--out", default="out/layer_profile.json")
    args = ap.parse_args(argv)
    cfg = DeepseekV41Config.flash()
    problem = layer_list_problem(cfg, args.layers)
    if problem:
        print(f"layer_profile: --layers {args.layers}: {problem}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("layer_profile: needs a CUDA GPU", file=sys.stderr)
        return 2
    ids = tuple(int(v) for v in args.layers.split(","))
    cps = tuple(int(v) for v in args.cp.split(","))
    if cps[0] != 1 and len(cps) > 1:
        print("layer_profile: --cp lists CP 1 first (the others are compared with it)")
        return 2
    layers = build_layers(cfg, ids, torch.bfloat16, "cuda", quant=args.quant)
    if args.keep_bf16_weights:
        for layer in layers.values():
            keep_dequantized_weights(layer)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    result: dict[str, object] = {
        "tokens": args.tokens, "prefix": args.prefix, "quant": args.quant, "cp": list(cps),
        "kept_bf16_weights": args.keep_bf16_weights,
        "layers": {}, "cp_excess": {},
    }  # fmt: skip
    by_stage_all: dict[str, object] = {}
    with torch.inference_mode():
        ctx1 = make_context(cfg, args.prefix, args.tokens, "cuda", torch.bfloat16, args.quant)
        for n in cps:
            ctx = ctx1 if n == 1 else ForwardContext.for_rank(ctx1.meta, ctx1.cache, SoloCPGroup(n))
            x = torch.randn(ctx.local_rows, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
            x *= 0.5
            for i in ids:  # in order: each layer reads what the earlier ones left in ctx
                key = str(i) if len(cps) == 1 else f"cp{n}/{i}"
                layers[i].forward(x, ctx)  # warm-up (compiles); the profiled call repeats it
                torch.cuda.synchronize()
                if i == ids[0]:  # the forward's first layer numbers the window (layer_peer too)
                    ctx.cross.attention = AttentionMemo()
                with torch.profiler.profile(activities=acts) as prof:
                    layers[i].forward(x, ctx)
                    torch.cuda.synchronize()
                events = prof.key_averages()
                print(f"layer {i} ({cfg.layer_role(i)}), {args.tokens} tokens after "
                      f"{args.prefix}, CP {n} rank 0, {args.quant}, eager:")  # fmt: skip
                print(events.table(sort_by="cuda_time_total", row_limit=args.rows))
                top = sorted(events, key=lambda e: e.device_time_total, reverse=True)[: args.rows]
                result["layers"][key] = [  # type: ignore[index]
                    {"name": e.key, "cuda_ms": e.device_time_total / 1e3, "calls": e.count}
                    for e in top
                ]
                stages = by_stage(list(prof.events()), args.stage_rows)
                print(f"layer {i}: CUDA time by stage (the {args.stage_rows} largest kernels each)")
                for where, kernels in stages.items():
                    print(f"  {where}: {float(kernels[0]['cuda_ms']):.3f} ms")  # type: ignore[arg-type]
                    for k in kernels[1:]:
                        ms, calls, op = float(k["cuda_ms"]), k["calls"], str(k["op"])[:28]  # type: ignore[arg-type]
                        print(f"      {ms:8.3f} ms  x{calls!s:<3} {op:28}  {k['kernel']}")
                by_stage_all[key] = stages
                if n > 1:
                    one = by_stage_all[f"cp1/{i}"]
                    result["cp_excess"][key] = _print_cp_excess(i, n, one, stages)  # type: ignore[index,arg-type]
    result["by_stage"] = by_stage_all
    return finish(args.out, {"benchmark": "layer_profile", **result})


if __name__ == "__main__":
    raise SystemExit(main())
