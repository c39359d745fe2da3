"""The warp-specialised Gluon fp8-weight GEMM (`kernels/fp8_gemm_gluon.py`) against the shipped
cuBLAS route, at the Flash attention projections' shapes and a CP rank's rows.

Per (GEMM, rows), CUDA-graph replays of (ms, median): `shipped` = `dequant_mm` (the activation's
quantization, the weight's per-call dequantization, cuBLAS bf16); `gluon` = the same
quantization, then `fp8_gemm_gluon` on the fp8 weight; `kept` = the quantization and cuBLAS on a
kept bf16 weight (`dense=`, opt-in: the floor of any per-call route); `gemm_only` the Gluon
kernel alone and `bf16_mm` cuBLAS alone on the same operands, with their TFLOP/s; `ungrouped`
the kernel alone with one weight tile per program group (token tile fastest at every size, against
`group_width`'s choice, column `group`). Ratios: gluon / shipped (< 1: faster), gemm_only / bf16_mm
and ungrouped / gemm_only. Also the largest |Δ| between the two
routes' bf16 outputs in bf16 ulps of the output's magnitude (the summation orders differ).

    PYTHONPATH=python python -m benchmarks.fp8_gemm_gluon --out out/fp8_gemm_gluon.json
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Any

import torch

from benchmarks.benchutil import Table, finish, tflops, time_graph
from dsv4cp.kernels.fp8_linear import dequant_mm, dequant_weight_bf16, quantized_act_bf16
from dsv4cp.ops.linear import quantize_fp8_blocks

Tensor = torch.Tensor


def _gluon_route(x: Tensor, w: Tensor, w_scale: Tensor) -> Tensor:
    from dsv4cp.kernels.fp8_gemm_gluon import fp8_gemm_gluon

    return fp8_gemm_gluon(quantized_act_bf16(x), w, w_scale)


# (name, K, N): wq_a+wkv (5120 → 1280 + 512), wq_b (1280 → 64·512), wo_b (8192 → 5120)
SHAPES = [("wqkv_a", 5120, 1792), ("wq_b", 1280, 32768), ("wo_b", 8192, 5120)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="2048,4096,16384", help="comma list of activation rows")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default="out/fp8_gemm_gluon.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print(
            "fp8_gemm_gluon: needs a CUDA GPU of compute capability 9.0 (Hopper)", file=sys.stderr
        )
        return 2
    from dsv4cp.kernels.fp8_gemm_gluon import fp8_gemm_gluon, group_width

    name = torch.cuda.get_device_name()
    table = Table(title=f"fp8-weight GEMM: Gluon vs the cuBLAS route, bf16, {name}")
    rows: list[dict[str, Any]] = []
    for gemm, k, n in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        w, w_scale = quantize_fp8_blocks(torch.randn(n, k, device="cuda", generator=g) * 0.02)
        dense = dequant_weight_bf16(w, w_scale)
        for m in (int(v) for v in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            a = quantized_act_bf16(x)
            shipped = dequant_mm(x, w, w_scale)
            routed = _gluon_route(x, w, w_scale)
            big = torch.maximum(shipped.float().abs(), routed.float().abs()).clamp_min(1e-30)
            ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(big)))
            diff_ulps = float(((shipped.float() - routed.float()).abs() / ulp).max())
            timed = {
                "shipped": partial(dequant_mm, x, w, w_scale),
                "gluon": partial(_gluon_route, x, w, w_scale),
                "kept": partial(dequant_mm, x, w, w_scale, dense=dense),
                "gemm_only": partial(fp8_gemm_gluon, a, w, w_scale),
                "ungrouped": partial(fp8_gemm_gluon, a, w, w_scale, group=1),
                "bf16_mm": partial(torch.mm, a, dense.t()),
            }
            row: dict[str, Any] = {"gemm": gemm, "rows": m, "K": k, "N": n, "dtype": "bf16"}
            for key, fn in timed.items():
                row[f"{key}_ms"] = time_graph(fn, iters=args.iters, replays_per_iter=5)["median_ms"]
            flops = 2.0 * m * n * k
            row["gemm_only_tflops"] = tflops(flops, row["gemm_only_ms"])
            row["bf16_mm_tflops"] = tflops(flops, row["bf16_mm_ms"])
            row["gluon_over_shipped"] = row["gluon_ms"] / row["shipped_ms"]
            row["gemm_only_over_bf16_mm"] = row["gemm_only_ms"] / row["bf16_mm_ms"]
            row["group"] = group_width(m, n, k)
            row["ungrouped_over_gemm_only"] = row["ungrouped_ms"] / row["gemm_only_ms"]
            row["max_diff_bf16_ulps"] = diff_ulps
            rows.append(row)
            table.add(row)
    table.print()
    return finish(args.out, {"benchmark": "fp8_gemm_gluon", "gpu": name, "rows": rows})


if __name__ == "__main__":
    raise SystemExit(main())
