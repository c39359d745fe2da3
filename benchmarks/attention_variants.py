"""A/B of the routed half-buffer Gluon attention kernel against variant kernel files, one process.

    PYTHONPATH=python python -m benchmarks.attention_variants --variant qov=ab/qov.py \
        [--variant ...] [--regs 208:48] --out out/attention_variants.json

A variant file is a copy of python/dsv4cp/kernels/attention_gluon_halves.py with one change (the
`halves-*` branches hold them); it is loaded as a module of dsv4cp.kernels beside the routed one.
The routed file imports its math warpgroups from attention_gluon_halves_math.py: a variant of
the math inlines its changed copy of them.
Every kernel is first checked against the ops twin on small shapes (odd and even tile counts, −1
and out-of-range indices, a row without keys; |Δ| < 2e-2 as in the GPU tests); a variant that
fails is not timed. Then all are timed in interleaved rounds (CUDA-graph replays; the median of
the rounds' medians) on the shape of `benchmarks.kernels --only attn`: T 4096, H 64 × D 512, K 640
random indices, N 20480 rows, bf16, FlashMLA's sparse prefill beside them when `flash_mla`
imports. The ratios are against the routed kernel at its default grant and against FlashMLA.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import statistics
import sys
from pathlib import Path
from types import ModuleType

import torch

from benchmarks import benchutil
from benchmarks.kernels import _reg_grants
from benchmarks.kernels_attention import Kernel, flashmla_sparse
from benchmarks.kernels_common import _maxdiff, _ms
from dsv4cp import ops

ROUTED = "routed"
SHAPE = (4096, 64, 512, 640, 20480)  # T, H, D, K, N
CHECKS = ((37, 3000, 640), (29, 500, 576), (16, 200, 64), (16, 200, 128), (24, 1000, 192))
TOL = 2e-2


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"dsv4cp.kernels._variant_{name}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--variant {name}: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    if not hasattr(module, "sparse_attention_gluon_halves"):
        raise SystemExit(f"--variant {name}: {path} has no sparse_attention_gluon_halves")
    return module


def _variant(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"want NAME=FILE with an existing file, got {text!r}")
    return name, Path(path)


def _check(kernels: dict[str, Kernel]) -> dict[str, float]:
    """The largest |kernel − twin| of each kernel over CHECKS."""
    worst = dict.fromkeys(kernels, 0.0)
    g = torch.Generator(device="cuda").manual_seed(0)
    for t, n, k in CHECKS:
        q = torch.randn(t, 64, 512, device="cuda", generator=g).bfloat16()
        kv = torch.randn(n, 512, device="cuda", generator=g).bfloat16()
        idx = torch.randint(0, n, (t, k), device="cuda", generator=g, dtype=torch.int32)
        idx[::3, k // 2 :] = -1
        idx[1, : k // 4] = n + 7  # past the cache: masked like −1
        idx[5, :] = -1  # no valid key: zeros
        sink = torch.randn(64, device="cuda", generator=g)
        # the twin gathers every index ≥ 0: it is given the kernels' masking of out-of-range ones
        ref = ops.sparse_attention(q, kv, torch.where(idx < n, idx, -1), sink, 512**-0.5)
        for name, fn in kernels.items():
            d = _maxdiff(fn(q, kv, idx, sink, 512**-0.5), ref)  # nan: finiteness differs
            worst[name] = float("nan") if math.isnan(d) else max(worst[name], d)
    return worst


def hopper_gluon(script: str) -> bool:
    """Whether Gluon and a Hopper GPU are here; where not, `script` says it needs them."""
    from dsv4cp.kernels.attention_gluon import gluon_attention_available

    if torch.cuda.is_available() and gluon_attention_available(
        torch.empty(1, 64, 512, device="cuda")
    ):
        return True
    print(f"{script} needs Gluon and a Hopper GPU")
    return False


def shape_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """The timed inputs at SHAPE, seed 0: q, kv, random indices, sink, scale."""
    t, h, d, kk, n = SHAPE
    torch.manual_seed(0)
    q = torch.randn(t, h, d, device="cuda").bfloat16()
    kv = torch.randn(n, d, device="cuda").bfloat16()
    idx = torch.randint(0, n, (t, kk), device="cuda", dtype=torch.int32)
    sink = torch.randn(h, device="cuda")
    return q, kv, idx, sink, d**-0.5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", type=_variant, action="append", default=[],
                        metavar="NAME=FILE", help="a variant kernel file (repeatable)")  # fmt: skip
    parser.add_argument("--regs", type=_reg_grants, default=[], metavar="M:L,...",
                        help="also the routed kernel at these register grants")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30, help="graph replays a round")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.iters < 1:
        parser.error("--rounds and --iters must be at least 1")
    names = [name for name, _ in args.variant]
    if len(set(names)) != len(names) or {ROUTED, "FlashMLA"} & set(names):
        parser.error(f"variant names must be distinct and not {ROUTED!r} or 'FlashMLA': {names}")
    if not hopper_gluon("benchmarks/attention_variants.py"):
        return 2
    from dsv4cp.kernels import attention_gluon_halves as routed

    kernels: dict[str, Kernel] = {ROUTED: routed.sparse_attention_gluon_halves}
    for m, load in args.regs:
        kernels[f"{ROUTED} {m}/{load}"] = functools.partial(
            routed.sparse_attention_gluon_halves, math_regs=m, load_regs=load
        )
    for name, path in args.variant:
        kernels[name] = _load(name, path).sparse_attention_gluon_halves
    gpu = torch.cuda.get_device_name()
    print(f"GPU: {gpu}  torch {torch.__version__}", flush=True)
    worst = _check(kernels)
    for name, d in worst.items():
        print(f"check {name}: max |kernel - twin| {d:.3g}", flush=True)
    timed = {k: v for k, v in kernels.items() if worst[k] < TOL}
    t, h, d, kk, n = SHAPE
    q, kv, idx, sink, scale = shape_inputs()
    flashmla = flashmla_sparse()
    if flashmla is not None:
        timed["FlashMLA"] = flashmla
    rounds: dict[str, list[float]] = {k: [] for k in timed}
    for r in range(args.rounds):
        for name, fn in timed.items():
            rounds[name].append(_ms(lambda fn=fn: fn(q, kv, idx, sink, scale), args.iters))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.4f}" for k, v in rounds.items()), flush=True)
    med = {k: statistics.median(v) for k, v in rounds.items()}
    shape = f"T={t} H={h} D={d} K={kk} N={n}"
    table = benchutil.Table(title=f"sparse attention variants, {gpu}, {shape}, bf16")
    for name, ms in med.items():  # vs_*: the other's ms / this ms (> 1: this one is faster)
        table.add(kernel=name, ms=ms, max_diff=worst.get(name),
                  vs_routed=med[ROUTED] / ms if ROUTED in med else None,
                  vs_flashmla=med["FlashMLA"] / ms if "FlashMLA" in med else None)  # fmt: skip
    for name in kernels.keys() - timed.keys():  # failed the check: not timed
        table.add(kernel=name, ms=None, max_diff=worst[name])
    table.formats.update(ms="{:.4f}", vs_routed="{:.3f}", vs_flashmla="{:.3f}", max_diff="{:.3g}")
    table.print()
    ok = all(v < TOL for v in worst.values())  # nan compares False: a failure
    if args.out is None:
        return 0 if ok else 1
    payload = {"shape": shape, "dtype": "bf16", "rounds_ms": rounds, "median_ms": med,
               "max_diff": worst, "rows": table.rows}  # fmt: skip
    return benchutil.finish(args.out, payload, ok=ok)


if __name__ == "__main__":
    raise SystemExit(main())
