"""NVTX ranges, torch.profiler traces, stream timelines and the overlap metric.

Times are microseconds (the Chrome-trace unit). A kernel is a 4-tuple
`(name, stream, start_us, end_us)`; `Kernel` is the named form. The overlap metric is exact: a sweep
line over the per-stream unions of kernel intervals, so nested or back-to-back kernels on one stream
count as one stream.

NVTX ranges are host-side: they appear when Python runs (eager, warm-up, capture) and not for the
kernels of a replayed CUDA graph. Attribute replayed kernels by name or by the launch correlation
(`Trace.kernels_in`).
"""

from __future__ import annotations

import gzip
import json
import os
import re
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ContextDecorator
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import torch

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
GATHER_PATTERNS = ("nccl", "all_gather", "allgather", "gather")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


class Kernel(NamedTuple):
    name: str
    stream: int
    start_us: float
    end_us: float


class Range(NamedTuple):
    """A record_function / NVTX-like range. `lane` is the CPU thread id (cat "user_annotation")
    or the stream id (cat "gpu_user_annotation")."""

    name: str
    lane: int
    start_us: float
    end_us: float
    cat: str


Interval = tuple[float, float]


# ----------------------------------------------------------------------------- NVTX ranges


@cache
def _nvtx_on() -> bool:
    if os.environ.get("DSV4CP_NVTX", "1") == "0":
        return False
    return torch.cuda.is_available()


def _profiler_on() -> bool:
    return bool(torch._C._autograd._profiler_enabled())


class nvtx_range(ContextDecorator):
    """`with nvtx_range("layer3/gather"):` pushes an NVTX range on CUDA (unless DSV4CP_NVTX=0) and,
    while a torch profiler is recording, a `record_function` range so CPU traces show the name.
    With neither active it only does two flag checks. Also usable as a decorator."""

    __slots__ = ("_nvtx", "_rf", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._nvtx = False
        self._rf: Any = None

    def __enter__(self) -> nvtx_range:
        if _profiler_on():
            self._rf = torch.profiler.record_function(self.name)
            self._rf.__enter__()
        if _nvtx_on():
            torch.cuda.nvtx.range_push(self.name)
            self._nvtx = True
        return self

    def _recreate_cm(self) -> nvtx_range:
        return nvtx_range(self.name)  # fresh state per decorated call (recursion, threads)

    def __exit__(self, *exc: object) -> None:
        if self._nvtx:
            torch.cuda.nvtx.range_pop()
            self._nvtx = False
        if self._rf is not None:
            rf, self._rf = self._rf, None
            rf.__exit__(*exc)


# ----------------------------------------------------------------------------- traces


def _default_activities() -> list[torch.profiler.ProfilerActivity]:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def capture_trace(
    fn: Callable[[], object],
    *,
    path: str | os.PathLike[str],
    warmup: int = 1,
    iters: int = 1,
    activities: Sequence[torch.profiler.ProfilerActivity] | None = None,
    record_shapes: bool = False,
) -> Trace:
    """Run `fn` `warmup` times unprofiled, then `iters` times under torch.profiler (CPU, plus CUDA
    when available), export a Chrome/Perfetto JSON trace to `path` (".gz" compresses) and return
    it parsed. CUDA is synchronised before the profiler stops so every kernel is recorded."""
    for _ in range(warmup):
        fn()
    _sync()
    acts = list(activities) if activities is not None else _default_activities()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.profiler.profile(activities=acts, record_shapes=record_shapes) as prof:
        for _ in range(iters):
            fn()
        _sync()
    prof.export_chrome_trace(str(out))
    return Trace.load(out)


class _GpuEvent(NamedTuple):
    name: str
    cat: str
    device: int
    stream: int
    start_us: float
    end_us: float
    correlation: int | None


def _as_int(v: Any, default: int = -1) -> int:
    """int, or the last integer in a label such as "stream 7" (older kineto tids)."""
    try:
        return int(v)
    except (TypeError, ValueError):
        m = re.search(r"(-?\d+)\D*$", v) if isinstance(v, str) else None
        return int(m.group(1)) if m else default


class Trace:
    """A parsed Chrome trace as written by torch.profiler (kineto).

    GPU activity: events of cat "kernel", "gpu_memcpy", "gpu_memset" (stream from args["stream"],
    device from args["device"] or pid). CPU ranges: cat "user_annotation" (record_function);
    GPU-side ranges: cat "gpu_user_annotation". Launch events ("cuda_runtime"/"cuda_driver") link
    kernels to the CPU range they were launched from through args["correlation"].
    CPU-only traces simply have no GPU events: no streams are invented for them.
    """

    def __init__(self, events: Sequence[Mapping[str, Any]], path: str | None = None) -> None:
        self.path = path
        self._gpu: list[_GpuEvent] = []
        self._cpu_ranges: list[Range] = []
        self._gpu_ranges: list[Range] = []
        self._cpu_pids: list[int] = []  # pid of each CPU range, before sorting
        # (pid, tid) -> sorted launch timestamps and their correlation ids
        launches: dict[tuple[int, int], list[tuple[float, int]]] = {}
        for ev in events:
            if ev.get("ph") != "X":
                continue
            cat = ev.get("cat", "")
            start = float(ev.get("ts", 0.0))
            end = start + float(ev.get("dur", 0.0) or 0.0)
            args = ev.get("args") or {}
            name = str(ev.get("name", ""))
            if cat in GPU_CATS:
                stream = _as_int(args.get("stream", ev.get("tid")))
                device = _as_int(args.get("device", ev.get("pid")), 0)
                corr = args.get("correlation")
                self._gpu.append(
                    _GpuEvent(
                        name,
                        cat,
                        device,
                        stream,
                        start,
                        end,
                        None if corr is None else _as_int(corr),
                    )
                )
            elif cat == "user_annotation":
                self._cpu_ranges.append(Range(name, _as_int(ev.get("tid")), start, end, cat))
                self._cpu_pids.append(_as_int(ev.get("pid")))
            elif cat == "gpu_user_annotation":
                lane = _as_int(args.get("stream", ev.get("tid")))
                self._gpu_ranges.append(Range(name, lane, start, end, cat))
            elif cat in _LAUNCH_CATS and "correlation" in args:
                key = (_as_int(ev.get("pid")), _as_int(ev.get("tid")))
                launches.setdefault(key, []).append((start, _as_int(args["correlation"])))
        self._gpu.sort(key=lambda e: (e.start_us, e.stream))
        order = sorted(range(len(self._cpu_ranges)), key=lambda i: self._cpu_ranges[i].start_us)
        self._cpu_ranges = [self._cpu_ranges[i] for i in order]
        self._cpu_pids = [self._cpu_pids[i] for i in order]
        self._launch_ts: dict[tuple[int, int], list[float]] = {}
        self._launch_corr: dict[tuple[int, int], list[int]] = {}
        for key, lst in launches.items():
            lst.sort()
            self._launch_ts[key] = [t for t, _ in lst]
            self._launch_corr[key] = [c for _, c in lst]
        self._gpu_ranges.sort(key=lambda r: r.start_us)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Trace:
        p = str(path)
        opener = gzip.open if p.endswith(".gz") else open
        with opener(p, "rt") as f:
            data = json.load(f)
        events = data.get("traceEvents", []) if isinstance(data, dict) else data
        return cls(events, path=p)

    # -- GPU side

    def devices(self) -> list[int]:
        return sorted({e.device for e in self._gpu})

    def streams(self, device: int | None = None) -> list[int]:
        return sorted({e.stream for e in self._select(device, GPU_CATS)})

    def _select(self, device: int | None, cats: Iterable[str]) -> list[_GpuEvent]:
        cats = tuple(cats)
        evs = [e for e in self._gpu if e.cat in cats]
        if device is None:
            devs = {e.device for e in evs}
            if len(devs) > 1:
                raise ValueError(
                    f"trace has GPU events on devices {sorted(devs)}: pass device= "
                    "(streams of different devices must not be merged)"
                )
            return evs
        return [e for e in evs if e.device == device]

    def kernels(self, *, device: int | None = None, cats: Iterable[str] = GPU_CATS) -> list[Kernel]:
        """GPU activity sorted by start: kernels, memcpys and memsets by default."""
        return [Kernel(e.name, e.stream, e.start_us, e.end_us) for e in self._select(device, cats)]

    def kernels_in(
        self, prefix: str, *, device: int | None = None, cats: Iterable[str] = GPU_CATS
    ) -> list[Kernel]:
        """Kernels launched (by correlation id) from inside a CPU range whose name starts with
        `prefix`, on any stream. A replayed CUDA graph's kernels belong to the range around the
        replay call."""
        return self._launched_in(lambda n: n.startswith(prefix), device, cats)

    def _launched_in(
        self, match: Callable[[str], bool], device: int | None, cats: Iterable[str]
    ) -> list[Kernel]:
        corrs: set[int] = set()
        for r, pid in zip(self._cpu_ranges, self._cpu_pids, strict=True):
            if not match(r.name):
                continue
            ts = self._launch_ts.get((pid, r.lane))
            if ts is None:
                continue
            lo, hi = bisect_left(ts, r.start_us), bisect_right(ts, r.end_us)
            corrs.update(self._launch_corr[(pid, r.lane)][lo:hi])
        return [
            Kernel(e.name, e.stream, e.start_us, e.end_us)
            for e in self._select(device, cats)
            if e.correlation is not None and e.correlation in corrs
        ]

    def gather_kernels(
        self,
        *,
        patterns: Iterable[str] = GATHER_PATTERNS,
        tags: Iterable[str] = (),
        device: int | None = None,
    ) -> list[Kernel]:
        """Collective / gather kernels: name contains one of `patterns` (case-insensitive), or the
        kernel was launched inside a CPU range whose name contains one of `tags` (our CPGroup
        tags, e.g. "layer3/kv_raw")."""
        pats, tags = tuple(patterns), tuple(tags)
        picked = {k for k in self.kernels(device=device) if is_gather(k.name, pats)}
        if tags:
            picked.update(self._launched_in(lambda n: any(t in n for t in tags), device, GPU_CATS))
        return sorted(picked, key=lambda k: (k.start_us, k.stream))

    # -- ranges

    def ranges(self, prefix: str = "", *, gpu: bool = False) -> list[Range]:
        """CPU record_function ranges (or, with gpu=True, their GPU-side projections) whose name
        starts with `prefix`, sorted by start."""
        src = self._gpu_ranges if gpu else self._cpu_ranges
        return [r for r in src if r.name.startswith(prefix)]

    def range_names(self, prefix: str = "", *, gpu: bool = False) -> list[str]:
        seen: dict[str, None] = {}
        for r in self.ranges(prefix, gpu=gpu):
            seen.setdefault(r.name)
        return list(seen)

    def window(self, prefix: str, *, gpu: bool = False) -> Interval:
        """(first start, last end) over the ranges named `prefix*`."""
        rs = self.ranges(prefix, gpu=gpu)
        if not rs:
            kind = "gpu_user_annotation" if gpu else "user_annotation"
            raise KeyError(f"no {kind} range starts with {prefix!r}")
        return min(r.start_us for r in rs), max(r.end_us for r in rs)


def _stream_key(s: Any) -> tuple[int, Any]:
    return (0, s) if isinstance(s, int) else (1, str(s))


def is_gather(name: str, patterns: Iterable[str] = GATHER_PATTERNS) -> bool:
    low = name.lower()
    return any(p.lower() in low for p in patterns)


# ----------------------------------------------------------------------------- overlap metric


def span(kernels: Iterable[Sequence[Any]]) -> Interval:
    """(first start, last end) of the kernels; (0, 0) when empty."""
    ks = list(kernels)
    if not ks:
        return (0.0, 0.0)
    return min(float(k[2]) for k in ks), max(float(k[3]) for k in ks)


def _union(intervals: Iterable[Interval]) -> list[Interval]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _per_stream(kernels: Iterable[Sequence[Any]], window: Interval) -> dict[Any, list[Interval]]:
    lo, hi = window
    by: dict[Any, list[Interval]] = {}
    for k in kernels:
        s, e = max(float(k[2]), lo), min(float(k[3]), hi)
        if e > s:
            by.setdefault(k[1], []).append((s, e))
    return {st: _union(iv) for st, iv in by.items()}


def _resolve(kernels: list[Sequence[Any]], window: Interval | None) -> Interval:
    if window is None:
        return span(kernels)
    lo, hi = float(window[0]), float(window[1])
    if hi < lo:
        raise ValueError(f"window end {hi} < start {lo}")
    return lo, hi


def concurrency(
    kernels: Iterable[Sequence[Any]], window: Interval | None = None
) -> dict[int, float]:
    """Time (µs) inside the window with exactly n distinct streams busy, for each n ≥ 0."""
    ks = list(kernels)
    lo, hi = _resolve(ks, window)
    edges: list[tuple[float, int]] = []
    for ivs in _per_stream(ks, (lo, hi)).values():
        for s, e in ivs:
            edges += [(s, 1), (e, -1)]
    edges.sort()
    hist: dict[int, float] = {}
    active, t = 0, lo
    for x, d in edges:
        if x > t:
            hist[active] = hist.get(active, 0.0) + (x - t)
            t = x
        active += d
    if hi > t:
        hist[active] = hist.get(active, 0.0) + (hi - t)
    return hist


def overlap_intervals(
    kernels: Iterable[Sequence[Any]], window: Interval | None = None, *, min_streams: int = 2
) -> list[Interval]:
    """Maximal intervals inside the window where ≥ min_streams distinct streams are busy."""
    ks = list(kernels)
    lo, hi = _resolve(ks, window)
    edges: list[tuple[float, int]] = []
    for ivs in _per_stream(ks, (lo, hi)).values():
        for s, e in ivs:
            edges += [(s, 1), (e, -1)]
    edges.sort()
    out: list[Interval] = []
    active, start = 0, 0.0
    for x, d in edges:
        before = active
        active += d
        if before < min_streams <= active:
            start = x
        elif active < min_streams <= before and x > start:
            out.append((start, x))
    return _union(out)


def overlap_fraction(
    kernels: Iterable[Sequence[Any]], window: Interval | None = None, *, min_streams: int = 2
) -> float:
    """Fraction of the window (default: the kernels' span) during which ≥ min_streams distinct
    streams run kernels at once. 0.0 for no kernels or an empty window."""
    ks = list(kernels)
    lo, hi = _resolve(ks, window)
    if hi <= lo:
        return 0.0
    hist = concurrency(ks, (lo, hi))
    return sum(v for n, v in hist.items() if n >= min_streams) / (hi - lo)


def busy_fraction(
    kernels: Iterable[Sequence[Any]], window: Interval | None = None
) -> dict[Any, float]:
    """Per stream: fraction of the window during which it runs at least one kernel."""
    ks = list(kernels)
    lo, hi = _resolve(ks, window)
    if hi <= lo:
        return {k[1]: 0.0 for k in ks}
    per = _per_stream(ks, (lo, hi))
    out = {k[1]: 0.0 for k in ks}
    for st, ivs in per.items():
        out[st] = sum(e - s for s, e in ivs) / (hi - lo)
    return dict(sorted(out.items(), key=lambda kv: _stream_key(kv[0])))


def timeline_stats(
    kernels: Iterable[Sequence[Any]],
    window: Interval | None = None,
    *,
    highlight: Iterable[str] = GATHER_PATTERNS,
) -> dict[str, Any]:
    """JSON-ready summary for benchmark reports."""
    ks = list(kernels)
    lo, hi = _resolve(ks, window)
    gathers = [k for k in ks if is_gather(str(k[0]), highlight)]
    gather_busy = sum(
        e - s for s, e in _union((max(float(k[2]), lo), min(float(k[3]), hi)) for k in gathers)
    )
    return {
        "window_us": [lo, hi],
        "window_len_us": hi - lo,
        "n_kernels": len(ks),
        "streams": sorted({k[1] for k in ks}, key=_stream_key),
        "overlap_fraction": overlap_fraction(ks, (lo, hi)),
        "busy_fraction": {str(s): v for s, v in busy_fraction(ks, (lo, hi)).items()},
        "gather_kernels": len(gathers),
        "gather_busy_us": gather_busy,
    }


# ----------------------------------------------------------------------------- timeline plot


def plot_timeline(
    kernels: Iterable[Sequence[Any]],
    path_png: str | os.PathLike[str],
    *,
    title: str,
    highlight: Iterable[str] = ("nccl", "all_gather", "gather"),
    window: Interval | None = None,
    stream_names: Mapping[Any, str] | None = None,
) -> float:
    """Draw one lane per stream (kernels as bars, gathers in a distinct colour, a top lane marking
    where ≥ 2 streams overlap), time in µs from the window start. Writes a PNG and returns the
    overlap fraction shown in the title. Uses the Agg canvas directly (no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    ks = list(kernels)
    lo, hi = _resolve(ks, window)
    frac = overlap_fraction(ks, (lo, hi))
    hl = tuple(highlight)
    streams = sorted({k[1] for k in ks}, key=_stream_key)
    names = dict(stream_names or {})

    fig = Figure(figsize=(12, 1.8 + 0.45 * (len(streams) + 1)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    c_kernel, c_gather, c_overlap = "tab:blue", "tab:red", "tab:green"
    for lane, st in enumerate(streams):
        plain, gath = [], []
        for k in ks:
            if k[1] != st:
                continue
            s, e = max(float(k[2]), lo), min(float(k[3]), hi)
            if e < s:
                continue
            bar = (s - lo, max(e - s, (hi - lo) * 1e-4))  # keep 0-length kernels visible
            (gath if is_gather(str(k[0]), hl) else plain).append(bar)
        ax.broken_barh(plain, (lane - 0.4, 0.8), facecolors=c_kernel, edgecolor="none")
        ax.broken_barh(gath, (lane - 0.4, 0.8), facecolors=c_gather, edgecolor="none")
    top = len(streams)
    ov = [(s - lo, e - s) for s, e in overlap_intervals(ks, (lo, hi))]
    ax.broken_barh(ov, (top - 0.3, 0.6), facecolors=c_overlap, edgecolor="none")

    labels = [f"{names[s]} (stream {s})" if s in names else f"stream {s}" for s in streams]
    ax.set_yticks(range(top + 1), labels + ["≥2 streams"])
    ax.set_ylim(-0.7, top + 0.7)
    ax.invert_yaxis()
    ax.set_xlim(0.0, hi - lo if hi > lo else 1.0)
    ax.set_xlabel(f"time (µs) from {lo:.3f}")
    ax.set_title(f"{title} — overlap {frac:.1%} of {hi - lo:.1f} µs")
    ax.grid(axis="x", alpha=0.3)
    if not ks:
        ax.text(0.5, 0.5, "no GPU kernel events", transform=ax.transAxes, ha="center")
    fig.legend(
        handles=[
            Patch(color=c_kernel, label="kernel"),
            Patch(color=c_gather, label="gather / collective"),
            Patch(color=c_overlap, label="≥2 streams busy"),
        ],
        loc="outside lower center",
        ncol=3,
        fontsize="small",
        frameon=False,
    )
    out = Path(path_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return frac


__all__ = [
    "GATHER_PATTERNS",
    "GPU_CATS",
    "Kernel",
    "Range",
    "Trace",
    "busy_fraction",
    "capture_trace",
    "concurrency",
    "is_gather",
    "nvtx_range",
    "overlap_fraction",
    "overlap_intervals",
    "plot_timeline",
    "span",
    "timeline_stats",
]
