"""Torch-profiler CUDA time per dsv4cp stage (the `record_function` ranges of `observe.timing`)."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from torch.autograd import DeviceType

# A kernel no aten op launched (a Triton launch) is charged here when no stage range holds it.
UNSTAGED = "-"


def _on_cpu(e: Any) -> bool:
    return e.device_type == DeviceType.CPU


def _innermost(ranges: list[Any], k: Any) -> str:
    """The shortest device-side stage range on k's device and stream that contains k."""
    best, width = UNSTAGED, float("inf")
    where = (k.device_index, k.device_resource_id)
    for r in ranges:
        t, kt = r.time_range, k.time_range
        inside = t.start <= kt.start and kt.end <= t.end
        if inside and (r.device_index, r.device_resource_id) == where and t.end - t.start < width:
            best, width = r.name, t.end - t.start
    return best


def by_stage(events: list[Any], rows: int) -> dict[str, list[dict[str, object]]]:
    """CUDA time per (innermost enclosing dsv4cp stage, launching op, kernel). A kernel an aten
    op launched is charged to the nearest `record_function` range above that op; a kernel no
    CPU op carries (Triton launches have no aten op) to the innermost device-side range of a
    stage that holds it in time on its stream (op "(no aten op)")."""
    acc: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    stages = {e.name for e in events if e.is_user_annotation and _on_cpu(e)}
    # an op's kernels by (name, duration): their device-side events are skipped below (torch
    # 2.11's events carry no link from a kernel to its op; the op's record is its duration)
    carried: Counter[tuple[str, float]] = Counter()
    for e in events:
        if not _on_cpu(e) or not e.kernels or e.is_user_annotation:
            continue
        p, where = e.cpu_parent, UNSTAGED
        while p is not None:
            if p.is_user_annotation:
                where = p.name
                break
            p = p.cpu_parent
        for k in e.kernels:
            carried[(k.name, k.duration)] += 1
            acc[(where, e.name, k.name)][0] += k.duration / 1e3
            acc[(where, e.name, k.name)][1] += 1
    ranges = [e for e in events if not _on_cpu(e) and e.name in stages]
    for e in events:
        if _on_cpu(e) or e.name in stages:
            continue
        span = e.time_range.end - e.time_range.start
        if carried[(e.name, span)] > 0:
            carried[(e.name, span)] -= 1
            continue
        key = (_innermost(ranges, e), "(no aten op)", e.name)
        acc[key][0] += span / 1e3
        acc[key][1] += 1
    out: dict[str, list[dict[str, object]]] = defaultdict(list)
    total: dict[str, float] = defaultdict(float)
    for (where, op, kernel), (ms, n) in sorted(acc.items(), key=lambda kv: -kv[1][0]):
        total[where] += ms
        if len(out[where]) < rows:
            out[where].append({"op": op, "kernel": kernel[:90], "cuda_ms": ms, "calls": n})
    order = sorted(total, key=lambda w: -total[w])
    head = {"op": "(all)", "kernel": "(stage total)"}
    return {w: [{**head, "cuda_ms": total[w]}, *out[w]] for w in order}
