"""Where one V4.1-Flash attention layer's time goes: the top CUDA kernels of its eager forward.

The layers and context of `layer_peer.py` (random weights, bf16, `--quant` numerics, one
request, a cold prefill of `--tokens`), each layer profiled alone after warm-up; prints a
torch.profiler table per layer and writes the top kernels as JSON.

    PYTHONPATH=python python -m benchmarks.layer_profile --tokens 16384 --layers 0,2 \
        --out out/layer_profile.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.benchutil import device_info, write_json
from benchmarks.layer_peer import build_layers, make_context
from benchmarks.profile_stages import by_stage
from dsv4cp.config import DeepseekV41Config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--layers", default="0,2", help="comma list of Flash layer ids")
    ap.add_argument("--quant", choices=["qat", "none"], default="qat")
    ap.add_argument("--rows", type=int, default=15)
    ap.add_argument("--stage-rows", type=int, default=6, help="kernels listed per stage")
    ap.add_argument("--out", default="out/layer_profile.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("layer_profile: needs a CUDA GPU", file=sys.stderr)
        return 2
    cfg = DeepseekV41Config.flash()
    ids = tuple(int(v) for v in args.layers.split(","))
    layers = build_layers(cfg, ids, torch.bfloat16, "cuda", quant=args.quant)
    x = torch.randn(args.tokens, cfg.hidden_size, device="cuda", dtype=torch.bfloat16) * 0.5
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    result: dict[str, object] = {"tokens": args.tokens, "quant": args.quant, "layers": {}}
    by_stage_all: dict[str, object] = {}
    with torch.inference_mode():
        ctx = make_context(cfg, 0, args.tokens, "cuda", torch.bfloat16, args.quant)
        for i in ids:  # in order: each layer reads what the earlier ones left in ctx
            layers[i].forward(x, ctx)  # warm-up (compiles); the profiled call repeats it
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=acts) as prof:
                layers[i].forward(x, ctx)
                torch.cuda.synchronize()
            events = prof.key_averages()
            print(f"layer {i} ({cfg.layer_role(i)}), {args.tokens} tokens, {args.quant}, eager:")
            print(events.table(sort_by="cuda_time_total", row_limit=args.rows))
            top = sorted(events, key=lambda e: e.device_time_total, reverse=True)[: args.rows]
            result["layers"][str(i)] = [  # type: ignore[index]
                {"name": e.key, "cuda_ms": e.device_time_total / 1e3, "calls": e.count} for e in top
            ]
            stages = by_stage(list(prof.events()), args.stage_rows)
            print(f"layer {i}: CUDA time by stage (the {args.stage_rows} largest kernels each)")
            for where, kernels in stages.items():
                print(f"  {where}: {float(kernels[0]['cuda_ms']):.3f} ms")
                for k in kernels[1:]:
                    ms, n, op = float(k["cuda_ms"]), k["calls"], str(k["op"])[:28]
                    print(f"      {ms:8.3f} ms  x{n!s:<3} {op:28}  {k['kernel']}")
            by_stage_all[str(i)] = stages
    result["by_stage"] = by_stage_all
    write_json(args.out, {"benchmark": "layer_profile", **result, "device": device_info()})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
