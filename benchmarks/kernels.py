"""Benchmark the Triton kernels beside their torch twins (dsv4cp.ops) and the peers on one GPU.

    PYTHONPATH=python python -m benchmarks.kernels --out out/kernels.json [--sweep] [--only mqa]

Sections: ceilings (bf16 GEMM, device copy), mqa (indexer logits), topk, attn (sparse attention with
sink: the Triton kernel, the Gluon sm_90 kernels on Hopper — pipelined, the routed half-buffer
one and the warp-specialised one; `--gluon-ws` adds the latter's other configuration — and
FlashMLA's sparse prefill as the peer when `flash_mla` imports), rows (fused SWA store and the
ratio-1/2 compressor), rope (the RoPE-only passes: the q tail, the index queries, previous config vs
default), workspace (FlashMLA's bf16 workspace over the caches: the rows' numbering by the Triton
`workspace_rows` kernels against their torch twins, the same decode), writers (the layer's SWA rows,
compressor and index keys, qat: the previous chain against the fused writers that quantize and
encode in their pass).
Every kernel row also records its max |kernel − twin|.
Compute rows give TFLOP/s and the fraction of the measured bf16 GEMM rate and of 790 TFLOP/s;
memory rows give GB/s over the bytes each op must move and the fraction of the measured copy rate
and of 4.3 TB/s. Times are medians of CUDA-graph replays timed with CUDA events (no Python
launch overhead; `eager_ms` where given is the plain call), warm L2 (inputs are reused).
"""

from __future__ import annotations

import argparse
import traceback
from pathlib import Path

import torch

from benchmarks import benchutil, kernels_attention, kernels_indexer, kernels_rows
from benchmarks import kernels_common as common

SECTIONS = {
    "ceilings": lambda a: common.bench_ceilings(),
    "mqa": lambda a: kernels_indexer.bench_mqa(a.sweep),
    "topk": lambda a: kernels_indexer.bench_topk(),
    "attn": lambda a: kernels_attention.bench_attention(a.sweep, a.gluon_ws, a.halves_regs),
    "rows": lambda a: kernels_rows.bench_rows(),
    "rope": lambda a: kernels_rows.bench_rope(),
    "workspace": lambda a: kernels_attention.bench_workspace(),
    "writers": lambda a: kernels_rows.bench_writers(),
}


def _reg_grants(text: str) -> list[tuple[int, int]]:
    """ "232:40,208:48" → [(232, 40), (208, 48)]."""
    try:
        return [(int(m), int(n)) for m, n in (pair.split(":") for pair in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"want M:L pairs separated by commas, got {text!r}"
        ) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    parser.add_argument("--sweep", action="store_true", help="time several kernel configs")
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    parser.add_argument(
        "--gluon-ws",
        action="store_true",
        help="attn: also time the warp-specialised Gluon kernel's other configuration, (64, 2)",
    )
    parser.add_argument(
        "--halves-regs",
        type=_reg_grants,
        default=[],
        metavar="M:L,...",
        help="attn: also time the half-buffer kernel at these (second math warpgroup, loader) "
        "register grants, e.g. 232:40,208:48 (§28)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU (run with TRITON_INTERPRET=1)"
    )
    args = parser.parse_args(argv)
    common.SWEEP = args.sweep
    if args.smoke:
        common.DEV, common.SMALL = "cpu", True
    elif not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU (or --smoke)")
        return 2
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name() if common.DEV == "cuda" else "cpu (smoke)"
    print(f"GPU: {gpu}  torch {torch.__version__}  shapes as printed; dtypes per row", flush=True)
    failures = {}
    for name in args.only.split(","):
        try:
            SECTIONS[name](args)
        except Exception:  # keep the other sections' numbers
            failures[name] = traceback.format_exc()
            print(f"section {name} failed:\n{failures[name]}", flush=True)
        torch.cuda.empty_cache()
    if args.out is not None:
        benchutil.write_json(
            args.out, {"ceilings": common.CEIL, "rows": common.ROWS, "failures": failures}
        )
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
