"""The routed experts' fp4 dequant kernel (`kernels/fp4_dequant.py`) at the MoE's launch shape
(32 experts × 2304 rows × 5120 columns → bf16), one run over tile configurations (rows per
program, columns per program, warps), the shipped one first as the baseline, then the byte-wise
candidate `dequant_fp4_pairs` (each packed byte loaded once, 16-byte loads and stores) over its
tiles: ms per launch, effective TB/s (half a byte read and two bytes written per element, plus
the fp32 scales), and the ratio to the baseline. Every output is checked equal to the baseline's.

    PYTHONPATH=python python -m benchmarks.fp4_dequant --out out/fp4_dequant.json
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import triton

from benchmarks.benchutil import Table, device_info, time_cuda, write_json
from dsv4cp.kernels import fp4_dequant as kernel
from dsv4cp.kernels._triton import TL_DTYPES
from dsv4cp.ops.quant import scale_to_float

ROWS, COLS = 32 * 2304, 5120
CONFIGS = [(1, 1024, 4), (2, 1024, 4), (4, 1024, 4), (4, 512, 4), (8, 1024, 8), (1, 2048, 8)]
# the byte-wise kernel (`dequant_fp4_pairs`): (rows, packed bytes, warps) per program
PAIRS_CONFIGS = [(4, 512, 4), (1, 1024, 4), (2, 1024, 4), (8, 512, 8), (4, 256, 4)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="out/fp4_dequant.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp4_dequant: needs a CUDA GPU", file=sys.stderr)
        return 2
    g = torch.Generator(device="cuda").manual_seed(0)
    packed = torch.randint(0, 256, (ROWS, COLS // 2), device="cuda", generator=g)
    packed = packed.to(torch.uint8)
    scale = torch.randint(118, 124, (ROWS, COLS // 32), device="cuda", generator=g)
    scale = scale_to_float(scale.to(torch.uint8).view(torch.float8_e8m0fnu)).contiguous()
    shipped = (kernel._BLOCK_R, kernel._BLOCK_K, kernel._WARPS)
    configs = [shipped] + [c for c in CONFIGS if c != shipped]
    moved = ROWS * COLS * (0.5 + 2) + scale.numel() * 4
    table = Table(title=f"fp4 dequant, {ROWS} x {COLS} -> bf16 (shipped: {shipped})")
    rows: list[dict[str, Any]] = []
    base: dict[str, Any] = {}  # the shipped kernel's ms and output, the first row

    def table_row(
        name: str, tile: tuple[int, int, int], ms: float, out: torch.Tensor
    ) -> dict[str, Any]:
        base.setdefault("ms", ms)
        base.setdefault("out", out)
        r, cols, warps = tile
        row = {
            "kernel": name,
            "rows": r,
            "cols": cols,
            "warps": warps,
            "ms": ms,
            "tb_per_s": moved / ms / 1e9,
            "baseline_over_this": base["ms"] / ms,
            "equal_to_baseline": bool(torch.equal(out, base["out"])),
        }
        table.add(row)
        return row

    for r, k, warps in configs:
        out = torch.empty(ROWS, COLS, dtype=torch.bfloat16, device="cuda")

        def launch(r: int = r, k: int = k, warps: int = warps, out: torch.Tensor = out) -> None:
            kernel._dequant_fp4_kernel[(triton.cdiv(ROWS, r), triton.cdiv(COLS, k))](
                packed, scale, out, ROWS, COLS, packed.stride(0), scale.stride(0),
                out.stride(0), BLOCK=32, BLOCK_R=r, BLOCK_K=k,
                OUT_DTYPE=TL_DTYPES[torch.bfloat16], EMULATE=False, num_warps=warps,
            )  # fmt: skip

        ms = time_cuda(launch, warmup=3, iters=args.iters)["median_ms"]
        rows.append(table_row("elements", (r, k, warps), ms, out))
    for r, nbytes, warps in PAIRS_CONFIGS:  # the byte-wise candidate, same inputs and output
        cfg = (r, nbytes, warps)
        out = kernel.dequant_fp4_pairs(packed, scale, out_dtype=torch.bfloat16, config=cfg)
        ms = time_cuda(
            lambda c=cfg: kernel.dequant_fp4_pairs(
                packed, scale, out_dtype=torch.bfloat16, config=c
            ),
            warmup=3,
            iters=args.iters,
        )["median_ms"]
        rows.append(table_row("pairs", (r, 2 * nbytes, warps), ms, out))
    table.print()
    write_json(
        args.out,
        {
            "benchmark": "fp4_dequant",
            "shape": [ROWS, COLS],
            "dtype": "bfloat16",
            "shipped": list(shipped),
            "rows": rows,
            "device": device_info(),
        },
    )
    print(f"wrote {args.out}")
    return 0 if all(r["equal_to_baseline"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
