"""The overlap metric over kernel intervals and the stream-timeline PNG.

A kernel is a 4-tuple `(name, stream, start_us, end_us)` (`observe.profiling.Kernel`). The metric is
exact: a sweep line over the per-stream unions of kernel intervals, so nested or back-to-back
kernels on one stream count as one stream.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

Interval = tuple[float, float]
GATHER_PATTERNS = ("nccl", "all_gather", "allgather", "gather")


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


def _edges(kernels: list[Sequence[Any]], window: Interval) -> list[tuple[float, int]]:
    """Sweep-line events, sorted: (start, +1) and (end, -1) of each stream's busy intervals."""
    edges: list[tuple[float, int]] = []
    for ivs in _per_stream(kernels, window).values():
        for s, e in ivs:
            edges += [(s, 1), (e, -1)]
    edges.sort()
    return edges


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
    edges = _edges(ks, (lo, hi))
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
    edges = _edges(ks, (lo, hi))
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
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ModuleNotFoundError as missing:
        raise ModuleNotFoundError(
            "plot_timeline needs matplotlib: pip install 'dsv4cp[plot]'"
        ) from missing

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
        plain: list[Interval] = []
        gath: list[Interval] = []
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
