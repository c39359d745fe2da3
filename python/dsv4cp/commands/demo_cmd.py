"""`dsv4cp demo`: a CP prefill of the tiny model that shows CP matches CP=1 and where time goes."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from dsv4cp.commands.common import (
    add_cp_args,
    add_model_args,
    check_cp_args,
    check_cpu_size,
    check_fake_side_streams,
    int_list,
    positive_int_list,
    scenario_from_args,
)

DEFAULT_LENS, DEFAULT_PREFIX = (96, 300), (0, 40)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="CP prefill of the tiny model: agreement and stage times")
    add_cp_args(p)
    add_model_args(p)
    p.add_argument("--lens", type=positive_int_list, default=DEFAULT_LENS, help="prompt lengths")
    p.add_argument(
        "--prefix",
        type=int_list,
        default=None,
        help="cached prefix per prompt (default 0,40 with the default --lens, else none)",
    )
    p.add_argument("--chunk", type=int, default=128, help="chunked-prefill size (0 = one chunk)")
    p.add_argument("--multistream", action="store_true", help="CP=N with multistream (CUDA)")
    p.add_argument(
        "--graphs",
        action="store_true",
        help="CP=N replays breakable CUDA graphs (CUDA); prints capture time/memory",
    )
    return p


def _stage_table(rows: list[tuple[str, float, int]], title: str) -> str:
    total = sum(ms for _, ms, _ in rows) or 1.0
    lines = [title, f"  {'stage':<18} {'ms':>9} {'share':>7} {'calls':>6}"]
    for name, ms, n in rows:
        lines.append(f"  {name:<18} {ms:>9.2f} {100 * ms / total:>6.1f}% {n:>6}")
    lines.append(f"  {'total':<18} {total:>9.2f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from dsv4cp.observe.timing import StageTimer
    from dsv4cp.tools.checking import compare, run_cp_scenario, run_scenario, summarize

    prefix = args.prefix
    if prefix is None:  # the default prefix belongs to the default lens
        prefix = DEFAULT_PREFIX if tuple(args.lens) == DEFAULT_LENS else (0,)
    sc = scenario_from_args(args, prefix)
    backend = check_cp_args(args)
    check_fake_side_streams(args, backend)
    check_cpu_size(args, sc.lens)
    if args.device == "cpu":
        # The CP ranks get cpu_count // cp threads each; give the CP=1 run the same, so the two
        # stage tables compare work, not thread counts.
        import os

        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.cp))
    cfg = sc.config
    what = sc.checkpoint or "tiny config (window 16) + mHC + MoE, random weights"
    print(f"dsv4cp demo: DeepSeek-V4.1, {what}, {sc.dtype}, quant={sc.quant}")
    print(f"  layers: {', '.join(f'{r.layer}:{r.name}' for r in cfg.layer_roles())}")
    print(
        f"  prompts {list(sc.lens)} tokens, cached prefixes {list(sc.prefix)}, "
        f"chunk {sc.chunk or 'none'}, {len(sc.steps())} prefill batches"
    )
    print(f"[1/2] CP=1 on {args.device} ...", flush=True)
    t = time.perf_counter()
    timer = StageTimer(args.device)
    ref = run_scenario(sc, timer=timer)
    t1 = time.perf_counter() - t
    print(f"      {t1:.2f} s")
    print(f"[2/2] CP={args.cp} over {backend} ({args.cp} ranks) ...", flush=True)
    t = time.perf_counter()
    variant = replace(sc, multistream=args.multistream, graphs=args.graphs)
    got, rank0_rows = run_cp_scenario(
        variant, args.cp, backend, timeout_s=args.timeout, check_order=True, timed=True
    )
    if args.graphs:  # graph replays keep no per-layer rows and no host stage times
        ref = {k: v for k, v in ref.items() if k in got}
    t2 = time.perf_counter() - t
    print(f"      {t2:.2f} s (including process start-up)")
    rep = summarize(compare(ref, got), 1e-5)
    print(f"\nCP={args.cp} vs CP=1, largest relative difference (fp32, tolerance 1e-5):")
    print("  (hidden: the layer's output rows. role: swa = window only; rN = compressed keys at")
    print("  ratio N; kv_source computes them, index_source its own top-k, reuse_topk an earlier")
    print("  layer's; candidate_source publishes blocks a candidate_consumer picks within)")
    print(f"  {'layer':<8} {'role':<36} {'hidden':>10}")
    for i, role in enumerate(cfg.layer_roles()):
        v = rep["layers_max_rel"].get(f"layer{i}")
        print(f"  {i:<8} {role.name:<36} " + (f"{v:>10.2e}" if v is not None else f"{'-':>10}"))
    print(
        f"  logits {rep['logits_max_rel']:.2e}; caches "
        f"{max(rep['caches_max_rel'].values(), default=0):.2e}; top-k identical "
        f"{rep['topk_identical']} -> {'PASS' if rep['pass'] else 'FAIL'}"
    )
    print()
    print(_stage_table(timer.rows(), "Where the time goes, CP=1 (host wall time per stage):"))
    print()
    if rank0_rows:
        print(_stage_table(rank0_rows, f"Where the time goes, CP={args.cp} rank 0:"))
    print(
        "\nOn CPU the gathers are gloo copies and every stage runs serially; on GPUs the same "
        "schedule runs with side streams and CUDA graphs (docs/performance.md)."
    )
    return 0 if rep["pass"] else 1
