"""Prefill of a small model at V4.1-Flash layer dims: eager vs graphs, serial vs multistream, CP.

The model has 6 layers covering every V4.1 layer role (SWA; ratio-2 kv+index source; ratio-2
top-k reuse; ratio-1 kv + candidate source; ratio-1 reuse; ratio-1 candidate consumer) at the
real Flash dimensions (d 5120, 64 heads × 512, q_lora 1280, 32 index heads × 128, top-k 512,
window 128, 2048 candidate blocks of 8), bf16, dense SwiGLU FFN, vocab 4096.

Per-rank time at CP = N is measured on one GPU with `SoloCPGroup`: rank 0 runs alone and its
all-gathers return its own shard tiled N times — right shapes, wrong data — so the number is
rank 0's compute for its 1/N of the rows against the full global context, without communication
(there is one GPU). One request, prefix 0, local tokens = global tokens / N.

    PYTHONPATH=python python -m benchmarks.prefill --local-tokens 512,2048,8192 --cp 1,2,4 \
        --out out/prefill.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from benchmarks.benchutil import Table, device_info, time_cuda, write_json
from benchmarks.model_layers import layer_subset_config
from dsv4cp.config import DeepseekV41Config
from dsv4cp.graphs.runner import GraphConfig
from dsv4cp.model import DeepseekV41Model
from dsv4cp.runner import PrefillRunner


class SoloCPGroup:
    """Timing only: rank 0 of `cp_size`, gathers tile the local shard (no other ranks exist)."""

    rank = 0
    capturable = True

    def __init__(self, cp_size: int) -> None:
        self.cp_size = cp_size

    def all_gather(self, x: torch.Tensor, *, tag: str) -> torch.Tensor:
        return x.repeat((self.cp_size,) + (1,) * (x.dim() - 1))

    def barrier(self) -> None:
        pass


def bench_config() -> DeepseekV41Config:
    """Flash dims, one layer per role, one residual stream and a dense SwiGLU FFN with dense bf16
    weights (the attention benchmark model of docs/performance.md §3)."""
    return layer_subset_config(blocks=False, quantization=None)


def build_model(cfg: DeepseekV41Config) -> DeepseekV41Model:
    model = DeepseekV41Model(cfg, dtype=torch.bfloat16, device="cuda", seed=None)
    model.init_random(0, device="cuda")  # a CUDA generator: the CPU one is slow at Flash dims
    return model


def measure(
    model: DeepseekV41Model, cfg: DeepseekV41Config, cp: int, total: int, iters: int
) -> dict[str, float]:
    prompt = torch.randint(0, cfg.vocab_size, (total,)).tolist()
    res = {}
    for graphs in (False, True):
        for ms in (False, True):
            group = SoloCPGroup(cp) if cp > 1 else None
            gcfg = (
                GraphConfig(buckets=(total,), max_requests=1, max_context=total) if graphs else None
            )
            runner = PrefillRunner(
                model,
                cp=group,
                multistream=ms,
                num_slots=total + 64,
                max_requests=2,
                max_context=total + 16,
                graphs=gcfg,
            )

            def step(runner: PrefillRunner = runner) -> None:
                runner.prefill({"r": prompt})
                runner.release("r")

            key = f"{'graph' if graphs else 'eager'}_{'multistream' if ms else 'serial'}"
            res[key] = time_cuda(step, warmup=2, iters=iters)["median_ms"]
            del runner
            torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--local-tokens", default="512,2048,8192")
    ap.add_argument("--cp", default="1,2,4")
    ap.add_argument(
        "--scaling-tokens",
        type=int,
        default=16384,
        help="global tokens of the CP 1/2/4 per-rank scaling rows (0 = none)",
    )
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="out/prefill.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("prefill: needs a CUDA GPU", file=sys.stderr)
        return 2
    cfg = bench_config()
    model = build_model(cfg)
    cps = [int(v) for v in args.cp.split(",")]
    cases = [
        (cp, local * cp) for cp in cps for local in (int(v) for v in args.local_tokens.split(","))
    ]
    cases += [(cp, args.scaling_tokens) for cp in cps if args.scaling_tokens]
    table = Table(
        title="prefill, 6 layers at V4.1-Flash dims, bf16, one request, prefix 0; "
        "ms per forward on rank 0"
    )
    rows = []
    for cp, total in dict.fromkeys(cases):
        res = measure(model, cfg, cp, total, args.iters)
        row = dict(cp=cp, local_tokens=total // cp, global_tokens=total, **res)
        row["speedup_graph_ms_vs_eager_serial"] = res["eager_serial"] / res["graph_multistream"]
        row["speedup_graph_vs_eager"] = res["eager_serial"] / res["graph_serial"]
        row["tok_per_s_best"] = total / (min(res.values()) / 1e3)
        rows.append(row)
        print(f"  cp {cp} global {total}: {res}", flush=True)
    for row in rows:  # per-rank time against CP=1 at the same global tokens
        base = [r for r in rows if r["cp"] == 1 and r["global_tokens"] == row["global_tokens"]]
        if base and row["cp"] > 1:
            ideal = min(base[0]["graph_serial"], base[0]["graph_multistream"]) / row["cp"]
            row["rank_time_vs_cp1_over_n"] = (
                min(row["graph_serial"], row["graph_multistream"]) / ideal
            )
        table.add(row)
    table.print()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    write_json(
        args.out,
        {
            "benchmark": "prefill",
            "dtype": "bfloat16",
            "layers": 6,
            "gpu": device_info().get("gpu_name"),
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
