"""The attention projections' per-call fp8 weight dequantization (`kernels/fp8_dequant.py`, the
cuBLAS route's weight operand) at V4.1-Flash shapes, bf16 out: the path as it was before
(the e8m0 scales converted by torch first, `host_scales=True`, tile (4, 512, 4): the baseline),
the kernel decoding the scale bytes itself over tile configurations (rows, columns, warps per
program), the shipped one first after the baseline: ms per call on the GPU (a CUDA graph's
replays, as the layers run: launches excluded, the scale conversion included), effective TB/s
(one byte read and two written per element) and the ratios to the baseline. Timed eagerly,
these calls measure their launches (~0.1 ms on the H200), not the kernel. Every output is
checked equal to the twin's (`ops.linear`).

At a CP rank's few rows the GEMMs shrink and these calls do not (docs/performance.md §12–13).

    PYTHONPATH=python python -m benchmarks.fp8_dequant --out out/fp8_dequant.json
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from benchmarks.benchutil import Table, finish, time_graph
from dsv4cp.kernels import fp8_dequant as kernel
from dsv4cp.ops import linear as ops_linear

# (name, out features, in features) of the Flash attention layer's fp8 projections
SHAPES = [("wq_b", 32768, 1280), ("wo_b", 5120, 8192), ("wqkv_a", 1792, 5120)]
BASELINE = (4, 512, 4)  # the tile the kernel had, with host-converted scales
CONFIGS = [(4, 512, 4), (8, 512, 4), (8, 512, 8), (16, 256, 4), (32, 128, 4), (32, 256, 8),
           (16, 512, 8), (2, 1024, 4)]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="out/fp8_dequant.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_dequant: needs a CUDA GPU", file=sys.stderr)
        return 2
    g = torch.Generator(device="cuda").manual_seed(0)
    configs = [kernel.CONFIG] + [c for c in CONFIGS if c != kernel.CONFIG]
    table = Table(title=f"fp8 weight dequant -> bf16 (shipped: {kernel.CONFIG}, in-kernel e8m0)")
    rows: list[dict[str, Any]] = []
    for name, n, k in SHAPES:
        w = (torch.randn(n, k, device="cuda", generator=g) * 40).to(torch.float8_e4m3fn)
        s = torch.randint(110, 135, ops_linear.fp8_scale_shape(n, k), device="cuda", generator=g)
        s = s.to(torch.uint8).view(torch.float8_e8m0fnu)
        want = ops_linear.dequant_fp8_blocks(w, s, out_dtype=torch.bfloat16)
        runs: list[tuple[str, tuple[int, int, int], dict[str, Any]]] = [
            ("host scales (before)", BASELINE, {"host_scales": True})
        ] + [("in-kernel e8m0", c, {}) for c in configs]
        base_ms = 0.0
        for path, cfg, kw in runs:

            def call(
                c: tuple[int, int, int] = cfg,
                kw: dict[str, Any] = kw,
                w: torch.Tensor = w,
                s: torch.Tensor = s,
            ) -> torch.Tensor:
                return kernel.dequant_fp8_blocks(w, s, out_dtype=torch.bfloat16, config=c, **kw)

            out = call()
            ms = time_graph(call, iters=args.iters, replays_per_iter=10)["median_ms"]
            base_ms = base_ms or ms
            row = {
                "weight": name,
                "shape": f"{n}x{k}",
                "path": path,
                "config": str(cfg),
                "shipped": path != runs[0][0] and cfg == kernel.CONFIG,
                "ms": ms,
                "tb_per_s": n * k * 3 / ms / 1e9,
                "before_over_this": base_ms / ms,
                "equal_to_twin": bool(torch.equal(out, want)),
            }
            table.add(row)
            rows.append(row)
    table.print()
    return finish(
        args.out,
        {
            "benchmark": "fp8_dequant",
            "dtype": "bfloat16",
            "shapes": SHAPES,
            "shipped": list(kernel.CONFIG),
            "rows": rows,
        },
        all(r["equal_to_twin"] for r in rows),
    )


if __name__ == "__main__":
    raise SystemExit(main())
