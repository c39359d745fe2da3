"""What `benchmarks/layer_peer.py` prints and writes: issue 15's targets judged on the run's
rows, the tables (layers, CP rows, a forward's mix, targets) and the JSON."""

from __future__ import annotations

import argparse
import os
from typing import Any, Protocol

from benchmarks import forward_mix
from benchmarks.benchutil import Table, device_info, write_json
from dsv4cp.config import DeepseekV41Config
from dsv4cp.ops.quant import QuantMode


class RunSummary(Protocol):
    """What the report uses of `layer_peer.Run`."""

    cfg: DeepseekV41Config
    ceiling: float
    flashmla: bool
    quant: QuantMode
    kept_bytes: int


def row_brief(row: dict[str, Any]) -> str:
    """A layer row's main numbers on one line (printed as each layer ends)."""
    keys = ("dsv4cp_ms", "peer_ms", "floor_ms", "speedup_vs_peer", "dsv4cp_over_floor")
    vals = " ".join(f"{k}={row[k]:.3f}" for k in keys if isinstance(row.get(k), float))
    return f"layer {row['layer']} {row['role']}: {vals}"


# ------------------------------------------------------------------------------ targets


def targets(rows: list[dict[str, Any]], cp_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 15's targets against this run: value, goal, met, and by how much if not."""
    out: list[dict[str, Any]] = []

    def add(what: str, case: str, role: str, value: float | None, goal: float, low: bool) -> None:
        if value is None:
            return
        met = value >= goal if low else value <= goal
        miss = None if met else (goal / value if low else value / goal)
        out.append(
            dict(target=what, case=case, role=role, value=value, goal=goal, met=met, missed_by=miss)
        )

    for r in rows:
        if "error" in r:
            continue
        role, case = f"{r['role']} (layer {r['layer']})", r["case"]
        if role.startswith("r2+kv_source+index_source") and case in ("cold16k", "cold64k"):
            goal = 3.5 if case == "cold16k" else 8.0
            add("index source vs peer (x)", case, role, r.get("speedup_vs_peer"), goal, True)
        if case.startswith("chunk16k"):
            add("each role vs peer (x)", case, role, r.get("speedup_vs_peer"), 4.0, True)
        if case in ("cold16k", "cold64k"):
            add("dsv4cp / floor", case, role, r.get("dsv4cp_over_floor"), 1.5, False)
        add("Triton / FlashMLA speed", case, role, r.get("triton_vs_flashmla"), 0.8, True)
        add("Gluon / FlashMLA speed", case, role, r.get("gluon_vs_flashmla"), 0.8, True)
    for r in cp_rows:
        if "rank_over_ideal" in r:
            goal = 1.12 if r["cp"] == 4 else 1.15
            add(
                f"CP {r['cp']} rank / ideal ({r.get('auto_executor', 'best')})",
                r["case"],
                f"{r['role']} (layer {r['layer']})",
                r.get("auto_rank_over_ideal", r["rank_over_ideal"]),
                goal,
                False,
            )
    return out


# ------------------------------------------------------------------------------ report


def report(
    args: argparse.Namespace,
    run: RunSummary | None,
    rows: list[dict[str, Any]],
    cp_rows: list[dict[str, Any]],
) -> None:
    cols = [
        "case", "layer", "role", "dsv4cp_ms", "peer_ms", "floor_ms", "speedup_vs_peer",
        "dsv4cp_over_floor", "gemm_ms", "idx_layer_ms", "idx_unfused_ms", "idx_peer_ms",
        "attn_layer_ms", "attn_triton_cached_ms", "attn_triton_ws_ms", "attn_triton_ms",
        "attn_flashmla_ms", "triton_vs_flashmla", "attn_gluon_ms", "gluon_vs_flashmla",
        "dsv4cp_path", "error",
    ]  # fmt: skip
    dims = "V4.1-Flash dims (d 5120, 64 heads x 512, index 32 x 128, top-k 512, window 128)"
    gpu = device_info().get("gpu_name", "cpu")
    table = Table(
        cols,
        title=f"layer_peer: {'tiny config (smoke)' if args.smoke else dims}, bf16, one request; "
        f"ms per layer forward on {gpu}",
    )
    for r in rows:
        table.add(r)
    table.print()
    if cp_rows:
        cp_table = Table(
            [
                "case",
                "cp",
                "layer",
                "role",
                "rank_ms",
                "ideal_ms",
                "rank_over_ideal",
                "rank_over_ideal_min",
                "rank_over_ideal_max",
                "auto_executor",
                "auto_rank_over_ideal",
                "error",
            ],
            title="CP per-rank time (rank 0 alone, gathers tile its shard; compute only)",
        )
        for r in cp_rows:
            cp_table.add(r)
        cp_table.print()
    mix = [] if run is None or not cp_rows else forward_mix.forward_mix(run.cfg, cp_rows)
    if mix:
        forward_mix.table(mix, "tiny config" if args.smoke else "V4.1-Flash").print()
    goals = targets(rows, cp_rows)
    if goals:
        t = Table(["target", "case", "role", "value", "goal", "met", "missed_by"], title="targets")
        for g in goals:
            t.add(g)
        t.print()
    payload = {
        "benchmark": "layer_peer",
        "dtype": "bfloat16",
        "config": "tiny" if args.smoke else "flash",
        "shapes": dims if not args.smoke else "tiny",
        "gpu": gpu,
        "ceiling_tflops": None if run is None else run.ceiling,
        "flashmla": None if run is None else run.flashmla,
        "quant": None if run is None else run.quant,
        "fused_indexer": "layer",
        "kept_bf16_weight_bytes": None if run is None else run.kept_bytes,
        "rows": rows,
        "cp_rows": cp_rows,
        "forward_mix": mix,
        "targets": goals,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    write_json(args.out, payload)
    print(f"wrote {args.out}", flush=True)
