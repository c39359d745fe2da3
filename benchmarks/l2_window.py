"""A/B of an L2 persisting window over the kv rows, around the routed Gluon sparse attention and
FlashMLA, in one process.

    PYTHONPATH=python python -m benchmarks.l2_window [--hit-ratio 1.0] --out out/l2_window.json

FlashMLA's sm_90 gathers carry an L2 evict-last policy that Triton 3.6's Gluon copies cannot
emit (docs/performance.md §29.1); ncu measured an L2 hit rate of 71 % for the routed kernel
against FlashMLA's 78 % (§30). A stream's access-policy window (CUDA's
`cudaStreamAttributeAccessPolicyWindow`: hits persisting, misses streaming) over the kv rows,
within `cudaLimitPersistingL2CacheSize`, is a host-side stand-in for that policy. This times both
kernels with the window off and on in interleaved rounds (eager launches on one stream timed by
CUDA events, since a graph's kernel nodes need the window as their own attribute; the persisting
lines are reset whenever the window goes off), checks the routed kernel's output is identical
either way, prints a table and writes JSON. Shape: `benchmarks.attention_variants`' (T 4096,
H 64 × D 512, K 640 random indices, N 20480 rows, bf16).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
from pathlib import Path

import torch

from benchmarks import benchutil
from benchmarks.attention_variants import ROUTED, SHAPE, hopper_gluon, shape_inputs
from benchmarks.kernels_attention import Kernel, flashmla_sparse
from benchmarks.kernels_common import _ms_eager

ACCESS_POLICY_WINDOW = 1  # cudaStreamAttributeAccessPolicyWindow
LIMIT_PERSISTING_L2 = 0x06  # cudaLimitPersistingL2CacheSize
MAX_PERSISTING_L2 = 108  # cudaDevAttrMaxPersistingL2CacheSize
MAX_WINDOW_BYTES = 109  # cudaDevAttrMaxAccessPolicyWindowSize
NORMAL, STREAMING, PERSISTING = 0, 1, 2  # cudaAccessProperty


class _Window(ctypes.Structure):  # cudaAccessPolicyWindow
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t),
                ("hit_ratio", ctypes.c_float), ("hit_prop", ctypes.c_int),
                ("miss_prop", ctypes.c_int)]  # fmt: skip


class _AttrValue(ctypes.Union):  # cudaStreamAttrValue: 64 bytes in CUDA 12 and 13
    _fields_ = [("window", _Window), ("size", ctypes.c_char * 64)]


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (its path from /proc/self/maps), else one by soname."""
    torch.cuda.init()
    paths = [line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
             if "libcudart.so" in line]  # fmt: skip
    for name in [*paths, "libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SystemExit("benchmarks/l2_window.py: no CUDA runtime library (libcudart) loads")


def _call(rt: ctypes.CDLL, name: str, *args: object) -> None:
    rc = getattr(rt, name)(*args)
    if rc != 0:
        raise SystemExit(f"benchmarks/l2_window.py: {name} returned CUDA error {rc}")


def _attribute(rt: ctypes.CDLL, attr: int) -> int:
    value = ctypes.c_int()
    _call(rt, "cudaDeviceGetAttribute", ctypes.byref(value), attr, torch.cuda.current_device())
    return value.value


def _set_window(rt: ctypes.CDLL, kv: torch.Tensor | None, nbytes: int, hit_ratio: float) -> None:
    """The current stream's window over kv's first `nbytes`, or none (and persisting lines
    reset to normal) when kv is None."""
    value = _AttrValue()
    if kv is not None:
        value.window = _Window(kv.data_ptr(), nbytes, hit_ratio, PERSISTING, STREAMING)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    _call(rt, "cudaStreamSetAttribute", stream, ACCESS_POLICY_WINDOW, ctypes.byref(value))
    if kv is None:
        _call(rt, "cudaCtxResetPersistingL2Cache")


def _hit_ratio(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"want a hit ratio in (0, 1], got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hit-ratio", type=_hit_ratio, default=1.0,
                        help="share of the window's accesses that persist")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30, help="launches a measurement")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.iters < 1:
        parser.error("--rounds and --iters must be at least 1")
    if not hopper_gluon("benchmarks/l2_window.py"):
        return 2
    from dsv4cp.kernels.attention_gluon_halves import sparse_attention_gluon_halves

    rt = _cudart()
    t, h, d, kk, n = SHAPE
    q, kv, idx, sink, scale = shape_inputs()
    kv_bytes = kv.numel() * kv.element_size()
    persisting = min(_attribute(rt, MAX_PERSISTING_L2), kv_bytes)
    nbytes = min(_attribute(rt, MAX_WINDOW_BYTES), kv_bytes)
    _call(rt, "cudaDeviceSetLimit", LIMIT_PERSISTING_L2, ctypes.c_size_t(persisting))
    kernels: dict[str, Kernel] = {ROUTED: sparse_attention_gluon_halves}
    flashmla = flashmla_sparse()
    if flashmla is not None:
        kernels["FlashMLA"] = flashmla
    gpu = torch.cuda.get_device_name()
    print(f"GPU: {gpu}  torch {torch.__version__}; window {nbytes / 2**20:.1f} MiB of kv "
          f"({kv_bytes / 2**20:.1f}), persisting limit {persisting / 2**20:.1f} MiB, "
          f"hit ratio {args.hit_ratio}", flush=True)  # fmt: skip
    off = sparse_attention_gluon_halves(q, kv, idx, sink, scale)
    _set_window(rt, kv, nbytes, args.hit_ratio)
    same = bool(torch.equal(off, sparse_attention_gluon_halves(q, kv, idx, sink, scale)))
    rounds: dict[str, list[float]] = {}
    try:
        for r in range(args.rounds):
            for window in (False, True):
                _set_window(rt, kv if window else None, nbytes, args.hit_ratio)
                for name, fn in kernels.items():
                    key = f"{name} window {'on' if window else 'off'}"
                    ms = _ms_eager(lambda fn=fn: fn(q, kv, idx, sink, scale), args.iters)
                    rounds.setdefault(key, []).append(ms)
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.4f}" for k, v in rounds.items()),
                  flush=True)  # fmt: skip
    finally:
        _set_window(rt, None, 0, args.hit_ratio)
        _call(rt, "cudaDeviceSetLimit", LIMIT_PERSISTING_L2, ctypes.c_size_t(0))
    med = {k: statistics.median(v) for k, v in rounds.items()}
    shape = f"T={t} H={h} D={d} K={kk} N={n}"
    table = benchutil.Table(title=f"L2 persisting window over kv, {gpu}, {shape}, bf16, eager")
    for name in kernels:  # on_vs_off, vs_flashmla: the other's ms / this ms (> 1: faster)
        for window in ("off", "on"):
            ms = med[f"{name} window {window}"]
            base = med.get("FlashMLA window off")
            table.add(kernel=name, window=window, ms=ms, on_vs_off=med[f"{name} window off"] / ms,
                      vs_flashmla=base / ms if base else None)  # fmt: skip
    table.formats.update(ms="{:.4f}", on_vs_off="{:.3f}", vs_flashmla="{:.3f}")
    table.print()
    print(f"routed output identical with the window: {same}")
    if args.out is None:
        return 0 if same else 1
    payload = {"shape": shape, "dtype": "bf16", "window_bytes": nbytes,
               "persisting_limit_bytes": persisting, "hit_ratio": args.hit_ratio,
               "rounds_ms": rounds, "median_ms": med, "output_identical": same,
               "rows": table.rows}  # fmt: skip
    return benchutil.finish(args.out, payload, ok=same)


if __name__ == "__main__":
    raise SystemExit(main())
