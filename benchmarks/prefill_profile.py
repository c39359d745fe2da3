"""Where the time of one prefill goes: the top CUDA kernels of the `prefill.py` model.

    PYTHONPATH=python python -m benchmarks.prefill_profile --tokens 2048 \
        --out out/prefill_profile.txt
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.prefill import bench_config, build_model
from dsv4cp.runner import PrefillRunner


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--out", default="out/prefill_profile.txt")
    args = ap.parse_args(argv)
    cfg = bench_config()
    model = build_model(cfg)
    n = args.tokens
    # Eager, so that every kernel is attributed to the op that launched it (at 2048 tokens the
    # forward is GPU-bound: graphs changed it by 2%).
    runner = PrefillRunner(model, num_slots=n + 64, max_requests=2, max_context=n + 16)
    prompt = torch.randint(0, cfg.vocab_size, (n,)).tolist()

    def step() -> None:
        runner.prefill({"r": prompt})
        runner.release("r")

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows)
    print(table)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write(f"prefill of {n} tokens, 6 layers at V4.1-Flash dims, bf16, eager, 3 forwards\n")
        f.write(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
