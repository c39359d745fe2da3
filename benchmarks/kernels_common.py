"""Settings and shared helpers of the kernel benchmark (benchmarks/kernels.py): the device,
sweep and smoke flags that `kernels.main` sets, the measured ceilings and the collected rows
(read them as attributes of this module, `common.DEV`, at call time), the timing, picking,
difference and row-printing helpers, and the ceilings section."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from benchmarks import benchutil  # noqa: E402

NOMINAL_TFLOPS = 790.0
NOMINAL_GBPS = 4300.0

ROWS: list[dict[str, Any]] = []
CEIL = {"tflops": NOMINAL_TFLOPS, "gbps": NOMINAL_GBPS}
DEV = "cuda"
SWEEP = False
SMALL = False  # --smoke: tiny shapes on the CPU interpreter, to check this script itself


def _pick(real, small):
    return small if SMALL else real


def _ms(fn: Callable[[], object], iters: int = 20) -> float:
    """Median ms per call: CUDA-graph replays on the GPU (no launch overhead: what a captured
    prefill sees), eager calls where capture fails and on the CPU smoke run."""
    if DEV == "cuda":
        try:
            return benchutil.time_graph(fn, warmup=2, iters=iters)["median_ms"]
        except Exception as exc:  # not capturable: eager timing instead
            print(f"  (eager timing: {type(exc).__name__})", flush=True)
    return benchutil.time_cuda(fn, warmup=3, iters=iters)["median_ms"]


def _ms_eager(fn: Callable[[], object], iters: int = 20) -> float:
    return benchutil.time_cuda(fn, warmup=3, iters=iters)["median_ms"]


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    fin = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), fin):
        return float("nan")
    return (a[fin] - b[fin]).abs().max().item() if fin.any() else 0.0


def _row(
    op: str,
    impl: str,
    shape: str,
    dtype: str,
    ms: float,
    *,
    flops: float = 0.0,
    nbytes: float = 0.0,
    **extra: Any,
) -> None:
    row: dict[str, Any] = {"op": op, "impl": impl, "shape": shape, "dtype": dtype, "ms": ms}
    if flops:
        tf = flops / (ms * 1e-3) / 1e12
        row.update(tflops=tf, frac_measured=tf / CEIL["tflops"], frac_nominal=tf / NOMINAL_TFLOPS)
    if nbytes:
        gb = nbytes / (ms * 1e-3) / 1e9
        row.update(gbps=gb, frac_measured=gb / CEIL["gbps"], frac_nominal=gb / NOMINAL_GBPS)
    row.update(extra)
    ROWS.append(row)
    rate = f"{row['tflops']:7.1f} TFLOP/s" if flops else f"{row.get('gbps', 0):7.0f} GB/s"
    frac = row.get("frac_measured")
    note = " ".join(
        f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items()
    )
    print(
        f"{op:10s} {impl:28s} {shape:34s} {ms:9.4f} ms {rate}"
        f" {'' if frac is None else f'{frac:6.1%}'} {note}",
        flush=True,
    )


def bench_ceilings() -> None:
    m = _pick(8192, 256)
    a = torch.randn(m, m, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=DEV, dtype=torch.bfloat16)
    ms = _ms_eager(lambda: a @ b, iters=10)
    CEIL["tflops"] = 2 * m**3 / (ms * 1e-3) / 1e12
    src = torch.empty(_pick(2**30, 2**20), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms_copy = _ms_eager(lambda: dst.copy_(src), iters=10)  # a captured copy runs on the DMA engine
    CEIL["gbps"] = 2 * src.numel() / (ms_copy * 1e-3) / 1e9
    _row("ceiling", "torch bf16 matmul", f"{m}x{m}x{m}", "bf16", ms, flops=2 * m**3)
    _row(
        "ceiling",
        "device copy",
        f"{src.numel()} B read + written",
        "u8",
        ms_copy,
        nbytes=2 * src.numel(),
    )
