"""The routed experts of one MoE layer at Flash dims (384 fp4 experts, top-6, d 5120, inter
2304), qat, bf16, two ways in one run on the same inputs:

- `chunked`: `grouped_expert_mlp(backend="grouped_mm")` with the layer's routed kernels — per
  32 experts, the fp4 weights dequantized to bf16 (Triton) and one `torch._grouped_mm` per
  projection (CUTLASS), chunk ends read on the host;
- `fused`: `backend="fused"`, `kernels.moe_fp4_gemm.grouped_fp4_mm`: one launch per projection,
  the fp4 codes decoded inside the GEMM, no host sync.

Routing: token-expert pairs drawn from a skewed random gate (some experts nearly empty). Prints
ms, TFLOP/s of the three projections' FLOPs (2·3·d·inter per pair), the ratio chunked / fused,
the bf16 GEMM ceiling measured in the same run, and the relative rms between the two outputs;
writes JSON.

    PYTHONPATH=python python -m benchmarks.moe_experts --tokens 4096,16384 --out out/moe.json
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Any

import torch

from benchmarks.benchutil import Table, finish, tflops, time_cuda
from dsv4cp.layers.moe import ROUTED_EXPERT_KERNELS
from dsv4cp.ops.moe_experts import grouped_expert_mlp
from dsv4cp.ops.moe_weights import ExpertStack

EXPERTS, TOP_K, DIM, INTER = 384, 6, 5120, 2304


def _stack(n: int, k: int, g: torch.Generator) -> ExpertStack:
    w = torch.randint(0, 256, (EXPERTS, n, k // 2), device="cuda", generator=g, dtype=torch.int32)
    s = torch.randint(118, 124, (EXPERTS, n, k // 32), device="cuda", generator=g)
    return ExpertStack(w.to(torch.uint8), s.to(torch.uint8).view(torch.float8_e8m0fnu))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="out/moe_experts.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_experts: needs a CUDA GPU", file=sys.stderr)
        return 2
    g = torch.Generator(device="cuda").manual_seed(0)
    w1, w3, w2 = _stack(INTER, DIM, g), _stack(INTER, DIM, g), _stack(DIM, INTER, g)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ceiling = tflops(2 * 8192**3, time_cuda(lambda: a @ a, warmup=3, iters=10)["median_ms"])
    table = Table(
        title=f"routed experts, {EXPERTS} fp4 experts top-{TOP_K}, d {DIM}, inter {INTER}, "
        f"qat, bf16 (bf16 GEMM ceiling {ceiling:.0f} TFLOP/s)"
    )
    rows: list[dict[str, Any]] = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        pairs = tokens * TOP_K
        weight = torch.rand(EXPERTS, device="cuda", generator=g) ** 4
        pick = torch.multinomial(weight, pairs, replacement=True, generator=g)
        counts = torch.bincount(pick, minlength=EXPERTS)
        x = torch.randn(pairs, DIM, device="cuda", generator=g).bfloat16()
        rw = torch.rand(pairs, device="cuda", generator=g)

        run = partial(
            grouped_expert_mlp, x, counts, w1, w3, w2, route_weight=rw, swiglu_limit=10.0,
            quant="qat", kernels=ROUTED_EXPERT_KERNELS,
        )  # fmt: skip

        flops = 2 * 3 * DIM * INTER * pairs
        chunked = partial(run, backend="grouped_mm")
        fused = partial(run, backend="fused")
        chunked_ms = time_cuda(chunked, warmup=2, iters=args.iters)
        fused_ms = time_cuda(fused, warmup=2, iters=args.iters)
        ref, got = chunked().float(), fused().float()
        row = {
            "tokens": tokens,
            "pairs": pairs,
            "chunked_ms": chunked_ms["median_ms"],
            "fused_ms": fused_ms["median_ms"],
            "chunked_over_fused": chunked_ms["median_ms"] / fused_ms["median_ms"],
            "chunked_tflops": tflops(flops, chunked_ms["median_ms"]),
            "fused_tflops": tflops(flops, fused_ms["median_ms"]),
            "floor_ms": flops / (ceiling * 1e12) * 1e3,
            "rel_rms": float((got - ref).norm() / ref.norm()),
        }
        rows.append(row)
        table.add(row)
    table.print()
    return finish(
        args.out,
        {
            "benchmark": "moe_experts",
            "dtype": "bfloat16",
            "quant": "qat",
            "shape": {"experts": EXPERTS, "top_k": TOP_K, "dim": DIM, "inter": INTER},
            "bf16_ceiling_tflops": ceiling,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    raise SystemExit(main())
