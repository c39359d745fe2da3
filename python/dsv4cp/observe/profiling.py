"""torch.profiler traces: `capture_trace` records one, `Trace` parses a Chrome trace.

Times are microseconds (the Chrome-trace unit). A kernel is a 4-tuple
`(name, stream, start_us, end_us)`; `Kernel` is the named form, which `observe.timeline` measures
(the overlap metric) and draws. Host ranges (NVTX, `record_function`) appear where Python runs,
not for the kernels of a replayed CUDA graph: attribute those by name or by the launch
correlation (`Trace.kernels_in`).
"""

from __future__ import annotations

import gzip
import json
import os
import re
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from dsv4cp.observe.timeline import GATHER_PATTERNS, Interval, is_gather

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
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


__all__ = ["GPU_CATS", "Kernel", "Range", "Trace", "capture_trace"]
