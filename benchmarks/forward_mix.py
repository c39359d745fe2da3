"""A CP rank's attention time over one whole forward, from `layer_peer`'s per-layer CP rows.

`layer_peer` times one layer of each role (the Flash config's layers 0, 1, 2, 3, 20, 21, 24).
The model runs each role many times (Flash: 1 first SWA layer, 1 SWA, 3 ratio-2 index sources,
15 ratio-2 reuse layers, 1 ratio-1 candidate source, 15 ratio-1 reuse layers, 4 candidate
consumers), so a forward's per-rank time is each layer's measured time weighted by its role's
count. This module maps every layer of the config to the measured layer of the same role and
sums, per (case, CP size): Σ rank ms against Σ ideal ms (CP 1 ms / N). The layer's own ratios
stay the targets' verdict (issue 15 judges each layer); this is what a forward's attention adds
up to. MoE and the rest of the block are not in it (row-local, outside `layer_peer`).

    python -m benchmarks.forward_mix benchmarks/results/layer_peer_cp_all_seed_h200_2026-12-05b.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from typing import Any

from benchmarks.benchutil import Table, write_json
from dsv4cp.config import DeepseekV41Config
from dsv4cp.roles import LayerRole

RoleKey = tuple[int, bool, bool, bool, bool, bool]


def role_key(role: LayerRole) -> RoleKey:
    """What a layer does, as timed: its ratio, whether it owns the compressor, publishes a
    top-k, publishes or consumes candidates, and whether it is the forward's first layer (which
    also numbers the window's and the store's rows for the forward, `context.AttentionMemo`)."""
    return (
        role.ratio,
        role.owns_compressor,
        role.index_source,
        role.candidate_source,
        role.candidate_consumer,
        role.layer == 0,
    )


def representatives(config: DeepseekV41Config, measured: list[int]) -> dict[int, int]:
    """Every layer of `config` → the measured layer of the same `role_key` (the first one
    listed). Raises ValueError naming the layers whose role nobody measured."""
    by_key: dict[RoleKey, int] = {}
    for i in measured:
        by_key.setdefault(role_key(config.layer_role(i)), i)
    out: dict[int, int] = {}
    missing: list[int] = []
    for i in range(config.num_hidden_layers):
        rep = by_key.get(role_key(config.layer_role(i)))
        if rep is None:
            missing.append(i)
        else:
            out[i] = rep
    if missing:
        raise ValueError(f"no measured layer has the role of layers {missing}")
    return out


def forward_mix(config: DeepseekV41Config, cp_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (case, cp) of `cp_rows` that timed every role: the forward's summed rank and ideal
    ms (rank: the `auto` executor's where the row has it, as the targets judge), their ratio, and
    the layer count each measured layer stands for, and each measured layer's share of the excess
    (count × (rank − ideal) ms). A (case, cp) missing a role gives a row with `error`."""
    groups: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    for r in cp_rows:
        if "rank_over_ideal" in r:
            groups.setdefault((r["case"], r["cp"]), {})[r["layer"]] = r
    out: list[dict[str, Any]] = []
    for (case, n), by_layer in sorted(groups.items()):
        row: dict[str, Any] = dict(case=case, cp=n, layers=config.num_hidden_layers)
        try:
            reps = representatives(config, sorted(by_layer))
        except ValueError as exc:
            row["error"] = str(exc)
            out.append(row)
            continue
        counts = Counter(reps.values())
        rank = sum(_rank_ms(by_layer[i]) * c for i, c in counts.items())
        ideal = sum(by_layer[i]["ideal_ms"] * c for i, c in counts.items())
        excess = {
            i: (_rank_ms(by_layer[i]) - by_layer[i]["ideal_ms"]) * c for i, c in counts.items()
        }
        row.update(
            rank_ms=rank,
            ideal_ms=ideal,
            rank_over_ideal=rank / ideal,
            excess_ms=rank - ideal,
            counts={str(i): c for i, c in sorted(counts.items())},
            excess_ms_by_layer={str(i): e for i, e in sorted(excess.items())},
            largest_excess_layer=max(excess, key=lambda i: excess[i]),
        )
        out.append(row)
    return out


def _rank_ms(row: dict[str, Any]) -> float:
    return float(row.get("auto_rank_ms", row["rank_ms"]))


def table(rows: list[dict[str, Any]], config_name: str) -> Table:
    t = Table(
        [
            "case",
            "cp",
            "layers",
            "rank_ms",
            "ideal_ms",
            "rank_over_ideal",
            "excess_ms",
            "largest_excess_layer",
            "error",
        ],
        title=f"one forward's attention layers per CP rank ({config_name} layer mix; "
        "each layer timed as its role's measured layer)",
    )
    for r in rows:
        t.add(r)
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="a layer_peer JSON with cp_rows")
    ap.add_argument("--out", default="", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    try:
        with open(args.results) as f:
            payload = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        print(f"forward_mix: cannot read {args.results}: {exc}", file=sys.stderr)
        return 2
    cp_rows = payload.get("cp_rows") or []
    configs = {
        "flash": (DeepseekV41Config.flash, "V4.1-Flash"),
        "tiny": (DeepseekV41Config.tiny, "tiny config"),
    }
    if payload.get("config") not in configs or not cp_rows:
        print(f"forward_mix: {args.results} has no layer_peer CP rows", file=sys.stderr)
        return 2
    make, name = configs[payload["config"]]
    rows = forward_mix(make(), cp_rows)
    table(rows, name).print()
    if args.out:
        write_json(args.out, {"benchmark": "forward_mix", "source": args.results, "rows": rows})
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
