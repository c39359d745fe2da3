"""The qat projection GEMM at the Flash attention layer's shapes (16K tokens), four ways:

- `triton`: `kernels.fp8_linear.launch_fp8_linear` (per-32 activation quantization, the
  block-scaled GEMM walking K in steps of 32: a bf16 MMA per step, both scales applied to each
  partial, fp32 out);
- `dequant_mm`: `kernels.fp8_linear.dequant_mm`, what `fp8_linear` runs for ≥ 512 bf16 rows: the
  same activation quantization, codes × scales as bf16 (exact), the weight dequantized to bf16
  in the call (exact), one cuBLAS bf16 GEMM with fp32 accumulation;
- `predequant_mm`: the same with the weight dequantized once, outside the timing (what the
  2026-12-03 run measured as `dequant_mm`);
- `bf16_mm`: the cuBLAS bf16 GEMM alone (the floor `layer_peer.py` uses).

Prints a table (ms, TFLOP/s, ratios, max |Δ| of `dequant_mm` against `triton` relative to the
largest output) and writes JSON.

    PYTHONPATH=python python -m benchmarks.fp8_gemm --out out/fp8_gemm.json
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Any

import torch

from benchmarks.benchutil import Table, finish, tflops, time_cuda
from dsv4cp.kernels.fp8_linear import (
    dequant_mm,
    dequant_weight_bf16,
    launch_fp8_linear,
    quantized_act_bf16,
)
from dsv4cp.ops.linear import quantize_fp8_blocks

# (name, tokens, K, N): wq_a+wkv (5120 → 1280 + 512), wq_b (1280 → 64·512), wo_b (8192 → 5120)
SHAPES = [
    ("wqkv_a", 16384, 5120, 1792),
    ("wq_b", 16384, 1280, 32768),
    ("wo_b", 16384, 8192, 5120),
]


def predequant_mm(x: torch.Tensor, w_bf16: torch.Tensor) -> torch.Tensor:
    return torch.mm(quantized_act_bf16(x), w_bf16.t())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="out/fp8_gemm.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_gemm: needs a CUDA GPU", file=sys.stderr)
        return 2
    table = Table(title="qat projection GEMM, bf16 activations, H200 (tokens × K → N)")
    rows: list[dict[str, Any]] = []
    for name, m, k, n in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        w, w_scale = quantize_fp8_blocks(torch.randn(n, k, device="cuda", generator=g) * 0.02)
        w_bf16 = dequant_weight_bf16(w, w_scale)
        flops = 2.0 * m * n * k
        ref = launch_fp8_linear(x, w, w_scale)
        alt = dequant_mm(x, w, w_scale)
        rel = float((alt.float() - ref.float()).abs().max() / ref.float().abs().max())
        ms = {
            "triton": time_cuda(partial(launch_fp8_linear, x, w, w_scale), iters=args.iters),
            "dequant_mm": time_cuda(partial(dequant_mm, x, w, w_scale), iters=args.iters),
            "predequant_mm": time_cuda(partial(predequant_mm, x, w_bf16), iters=args.iters),
            "bf16_mm": time_cuda(partial(torch.mm, x, w_bf16.t()), iters=args.iters),
        }
        row: dict[str, Any] = {"gemm": name, "tokens": m, "K": k, "N": n}
        for key, stats in ms.items():
            row[f"{key}_ms"] = stats["median_ms"]
            row[f"{key}_tflops"] = tflops(flops, stats["median_ms"])
        row["triton_over_dequant_mm"] = row["triton_ms"] / row["dequant_mm_ms"]
        row["dequant_mm_over_bf16_mm"] = row["dequant_mm_ms"] / row["bf16_mm_ms"]
        row["max_rel_diff"] = rel
        rows.append(row)
        table.add(row)
    table.print()
    return finish(args.out, {"benchmark": "fp8_gemm", "rows": rows})


if __name__ == "__main__":
    raise SystemExit(main())
