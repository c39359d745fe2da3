"""Helpers shared by the scripts under benchmarks/ (run them from the repository root as
`python -m benchmarks.<name>`): device facts, timers, a text table, JSON output.
(Random benchmark weights: `DeepseekV41Model.init_random(seed, device="cuda")`.)

Timers return a stats dict in milliseconds: `median_ms`, `mean_ms`, `min_ms`, `max_ms`, `std_ms`,
`p10_ms`, `p90_ms`, `iters`, `timer`. On CUDA each iteration is timed by its own pair of CUDA events
on the current stream; on CPU by `time.perf_counter`.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import IO, Any

import torch

# ----------------------------------------------------------------------------- device facts


def _pkg_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def device_info(device: int | None = None) -> dict[str, Any]:
    """Versions and the device a benchmark ran on (GPU facts when CUDA is available, else CPU)."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _pkg_version("triton"),
        "cuda_runtime": torch.version.cuda,
        "platform": platform.platform(),
        "hostname": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("DSV4CP_")},
    }
    if torch.cuda.is_available():
        idx = torch.cuda.current_device() if device is None else device
        p = torch.cuda.get_device_properties(idx)
        info.update(
            device="cuda",
            gpu_name=p.name,
            gpu_count=torch.cuda.device_count(),
            gpu_index=idx,
            sm_count=p.multi_processor_count,
            capability=f"{p.major}.{p.minor}",
            gpu_memory_gib=round(p.total_memory / 2**30, 2),
            l2_cache_mib=round(getattr(p, "L2_cache_size", 0) / 2**20, 2),
            cudnn=torch.backends.cudnn.version(),
            nccl=_nccl_version(),
        )
    else:
        info["device"] = "cpu"
    return info


def _nccl_version() -> str | None:
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 (builds without NCCL raise various errors)
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _git_rev() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            check=False,
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


# ----------------------------------------------------------------------------- timers


def summarize(times_ms: Sequence[float]) -> dict[str, Any]:
    """Stats dict over per-iteration times in ms."""
    if not times_ms:
        raise ValueError("no timings to summarize")
    ts = sorted(float(t) for t in times_ms)

    def q(p: float) -> float:  # linear-interpolated quantile
        x = p * (len(ts) - 1)
        i = int(x)
        return ts[i] if i + 1 >= len(ts) else ts[i] + (ts[i + 1] - ts[i]) * (x - i)

    return {
        "median_ms": statistics.median(ts),
        "mean_ms": statistics.fmean(ts),
        "min_ms": ts[0],
        "max_ms": ts[-1],
        "std_ms": statistics.pstdev(ts),
        "p10_ms": q(0.1),
        "p90_ms": q(0.9),
        "iters": len(ts),
    }


def _use_cuda(device: str | torch.device | None) -> bool:
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


class _L2Flusher:
    """Overwrites a buffer twice the L2 size before each timed iteration (cold-L2 numbers)."""

    def __init__(self) -> None:
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        nbytes = max(2 * int(getattr(p, "L2_cache_size", 0)), 64 * 2**20)
        self.buf = torch.empty(nbytes // 4, dtype=torch.int32, device="cuda")

    def __call__(self) -> None:
        self.buf.zero_()


def time_cuda(
    fn: Callable[[], object],
    *,
    warmup: int = 10,
    iters: int = 50,
    device: str | torch.device | None = None,
    flush_l2: bool = False,
) -> dict[str, Any]:
    """Time `fn()` per call. CUDA (default when available, or device="cuda"): one event pair per
    iteration on the current stream, optional L2 flush outside the pair. CPU: perf_counter."""
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if not _use_cuda(device):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return {**summarize(times), "timer": "perf_counter", "device": "cpu"}

    flush = _L2Flusher() if flush_l2 else None
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = _event_times(fn, iters, flush)
    return {**summarize(times), "timer": "cuda_event", "device": "cuda", "flush_l2": flush_l2}


def _event_times(
    fn: Callable[[], object], iters: int, flush: Callable[[], None] | None
) -> list[float]:
    """ms of each of `iters` calls, one CUDA event pair each on the current stream (the L2
    flush, when given, runs before the pair)."""
    pairs = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    for start, end in pairs:
        if flush is not None:
            flush()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in pairs]


def time_graph(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    iters: int = 50,
    replays_per_iter: int = 1,
    flush_l2: bool = False,
) -> dict[str, Any]:
    """Capture `fn()` once in a torch.cuda.CUDAGraph (after `warmup` eager calls on a side stream,
    as capture requires) and time its replays: one event pair per iteration around
    `replays_per_iter` replays; reported times are per replay. `fn` must be capturable: static
    shapes, no host sync, no CPU-dependent control flow between calls."""
    if not torch.cuda.is_available():
        raise RuntimeError("time_graph needs CUDA (CUDA graphs do not exist on CPU)")
    if iters < 1 or replays_per_iter < 1:
        raise ValueError(
            f"iters and replays_per_iter must be >= 1, got {iters}, {replays_per_iter}"
        )
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    try:
        flush = _L2Flusher() if flush_l2 else None
        graph.replay()  # first replay uploads the graph; keep it out of the timings

        def replays() -> None:
            for _ in range(replays_per_iter):
                graph.replay()

        torch.cuda.synchronize()
        times = [t / replays_per_iter for t in _event_times(replays, iters, flush)]
    finally:
        graph.reset()
    return {
        **summarize(times),
        "timer": "cuda_graph",
        "device": "cuda",
        "replays_per_iter": replays_per_iter,
        "flush_l2": flush_l2,
    }


def tflops(flops: float, ms: float) -> float:
    """Throughput in TFLOP/s for `flops` floating-point operations done in `ms` milliseconds."""
    if ms <= 0:
        raise ValueError(f"time must be > 0 ms, got {ms}")
    return flops / (ms * 1e-3) / 1e12


def gbps(nbytes: float, ms: float) -> float:
    """Bandwidth in GB/s (10^9 bytes per second) for `nbytes` moved in `ms` milliseconds."""
    if ms <= 0:
        raise ValueError(f"time must be > 0 ms, got {ms}")
    return nbytes / (ms * 1e-3) / 1e9


# ----------------------------------------------------------------------------- table


def _fmt_value(v: Any, spec: str | None) -> str:
    if v is None:
        return "-"
    if spec is not None and not isinstance(v, str):
        return spec.format(v)
    if isinstance(v, bool) or not isinstance(v, float):
        return str(v)
    if math.isnan(v) or math.isinf(v):
        return str(v)
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 1e6 or a < 1e-3:
        return f"{v:.3e}"
    if a >= 100:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.3f}"
    return f"{v:.4f}"


class Table:
    """Rows of dicts rendered as an aligned text (or Markdown) table.

    Columns appear in first-seen order unless given; numbers right-aligned, text left-aligned;
    missing cells are blank, None is "-". `formats` maps a column to a format string such as
    "{:.2f}". Ratio helpers add derived columns to the rows already present.
    """

    def __init__(
        self,
        columns: Sequence[str] | None = None,
        *,
        title: str | None = None,
        formats: Mapping[str, str] | None = None,
    ) -> None:
        self.title = title
        self.rows: list[dict[str, Any]] = []
        self._columns: list[str] = list(columns or [])
        self._fixed = columns is not None
        self.formats: dict[str, str] = dict(formats or {})

    @property
    def columns(self) -> list[str]:
        cols = list(self._columns)
        if not self._fixed:
            for r in self.rows:
                cols += [k for k in r if k not in cols]
        return cols

    def add(self, row: Mapping[str, Any] | None = None, /, **cells: Any) -> Table:
        self.rows.append({**(row or {}), **cells})
        return self

    def _add_column(self, name: str, fmt: str) -> None:
        if self._fixed and name not in self._columns:
            self._columns.append(name)
        self.formats.setdefault(name, fmt)

    def add_ratio(self, name: str, num: str, den: str, *, fmt: str = "{:.2f}x") -> Table:
        """row[name] = row[num] / row[den] for every row (None when missing or den == 0)."""
        for r in self.rows:
            a, b = r.get(num), r.get(den)
            r[name] = None if a is None or not b else a / b
        self._add_column(name, fmt)
        return self

    def add_relative(
        self,
        name: str,
        col: str,
        *,
        baseline: int | Mapping[str, Any] = 0,
        invert: bool = False,
        fmt: str = "{:.2f}x",
    ) -> Table:
        """row[name] = row[col] / base[col] (invert: base/row, e.g. a speedup over a time column).
        `baseline` is a row index or a dict of cells identifying the baseline row."""
        if isinstance(baseline, int):
            base_row = self.rows[baseline]
        else:
            matches = [r for r in self.rows if all(r.get(k) == v for k, v in baseline.items())]
            if len(matches) != 1:
                raise KeyError(f"baseline {dict(baseline)} matches {len(matches)} rows, need 1")
            base_row = matches[0]
        base = base_row.get(col)
        for r in self.rows:
            v = r.get(col)
            if v is None or base is None or (v if invert else base) == 0:
                r[name] = None
            else:
                r[name] = base / v if invert else v / base
        self._add_column(name, fmt)
        return self

    def render(self, style: str = "text") -> str:
        cols = self.columns
        cells = [
            [_fmt_value(r[c], self.formats.get(c)) if c in r else "" for c in cols]
            for r in self.rows
        ]
        numeric = [
            all(
                isinstance(r.get(c), (int, float)) and not isinstance(r.get(c), bool)
                for r in self.rows
                if r.get(c) is not None
            )
            for c in cols
        ]
        widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]

        def line(vals: Sequence[str], sep: str) -> str:
            parts = [
                v.rjust(w) if num else v.ljust(w)
                for v, w, num in zip(vals, widths, numeric, strict=True)
            ]
            return sep.join(parts).rstrip() if style == "text" else f"| {sep.join(parts)} |"

        if style == "text":
            out = [line(cols, "  "), "  ".join("-" * w for w in widths)]
            out += [line(row, "  ") for row in cells]
        elif style == "markdown":
            rule = [
                ("-" * (w - 1) + ":") if num else "-" * w
                for w, num in zip(widths, numeric, strict=True)
            ]
            out = [line(cols, " | "), f"| {' | '.join(rule)} |"]
            out += [line(row, " | ") for row in cells]
        else:
            raise ValueError(f"style must be 'text' or 'markdown', got {style!r}")
        if self.title:
            out.insert(0, self.title if style == "text" else f"**{self.title}**\n")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.render()

    def print(self, file: IO[str] | None = None) -> None:
        print(self.render(), file=file or sys.stdout, flush=True)


# ----------------------------------------------------------------------------- JSON output


def _json_default(o: Any) -> Any:
    if isinstance(o, torch.Tensor):
        return o.item() if o.numel() == 1 else o.tolist()
    if isinstance(o, (torch.dtype, torch.device, Path)):
        return str(o)
    if isinstance(o, enum.Enum):
        return o.value
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    if isinstance(o, (set, frozenset)):
        return sorted(o, key=str)
    if hasattr(o, "item") and callable(o.item):  # numpy scalars
        return o.item()
    if hasattr(o, "tolist") and callable(o.tolist):  # numpy arrays
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def source_digest() -> str:
    """sha1 (12 hex digits) of the `.py` files of the imported dsv4cp package and of benchmarks/
    (relative paths and bytes): which tree ran, also where the checkout's git metadata is not
    the tree's (the device's copy of the working tree reported a stale HEAD as `git_rev`)."""
    import dsv4cp

    h = hashlib.sha1()
    for root in (Path(dsv4cp.__file__).resolve().parent, Path(__file__).resolve().parent):
        for f in sorted(root.rglob("*.py")):
            h.update(f"{root.name}/{f.relative_to(root).as_posix()}\0".encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def run_meta() -> dict[str, Any]:
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(sys.argv),
        "git_rev": _git_rev(),
        "source_digest": source_digest(),
        "device": device_info(),
    }


def write_json(path: str | os.PathLike[str], payload: Mapping[str, Any]) -> dict[str, Any]:
    """Write `{"meta": {date, argv, git_rev, source_digest, device}, **payload}` to `path`
    (parents created, atomic replace) and return what was written. Tensors, dtypes, paths,
    enums, dataclasses and numpy values are converted."""
    if "meta" in payload:
        raise ValueError("payload must not have a top-level 'meta' key (write_json adds it)")
    doc = {"meta": run_meta(), **payload}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, indent=2, default=_json_default)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    tmp.write_text(text + "\n")
    os.replace(tmp, out)
    return json.loads(text)


def finish(path: str | os.PathLike[str], payload: Mapping[str, Any], ok: bool = True) -> int:
    """A benchmark's last step: `write_json(path, payload)` with the run's `device` beside the
    payload (as the benchmarks' results have it), "wrote <path>" printed, and the exit status:
    0, or 1 where `ok` is False (a variant's output differed from its reference)."""
    write_json(path, {**payload, "device": device_info()})
    print(f"wrote {path}", flush=True)
    return 0 if ok else 1


def read_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


__all__ = [
    "Table",
    "device_info",
    "gbps",
    "read_json",
    "run_meta",
    "summarize",
    "tflops",
    "time_cuda",
    "time_graph",
    "write_json",
]
