"""Torch-profiler CUDA time per dsv4cp stage (the `record_function` ranges of `observe.timing`)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any


def by_stage(events: list[Any], rows: int) -> dict[str, list[dict[str, object]]]:
    """CUDA time per (innermost enclosing dsv4cp stage, launching op, kernel): each kernel is
    charged to the nearest `record_function` range above the CPU event that launched it."""
    acc: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        if not e.kernels or e.is_user_annotation:
            continue
        p, where = e.cpu_parent, "-"
        while p is not None:
            if p.is_user_annotation:
                where = p.name
                break
            p = p.cpu_parent
        for k in e.kernels:
            acc[(where, e.name, k.name)][0] += k.duration / 1e3
            acc[(where, e.name, k.name)][1] += 1
    out: dict[str, list[dict[str, object]]] = defaultdict(list)
    total: dict[str, float] = defaultdict(float)
    for (where, op, kernel), (ms, n) in sorted(acc.items(), key=lambda kv: -kv[1][0]):
        total[where] += ms
        if len(out[where]) < rows:
            out[where].append({"op": op, "kernel": kernel[:90], "cuda_ms": ms, "calls": n})
    order = sorted(total, key=lambda w: -total[w])
    head = {"op": "(all)", "kernel": "(stage total)"}
    return {w: [{**head, "cuda_ms": total[w]}, *out[w]] for w in order}
