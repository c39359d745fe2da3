"""`dsv4cp check`: a model at CP=N against CP=1, largest differences per layer (the tiny config
with mHC + MoE, or `--checkpoint DIR`); `--ep` also runs CP=N with the routed experts split over
the same N ranks (expert parallelism, docs/ep.md) against CP=1, EP=1."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from dsv4cp.commands.common import (
    UsageError,
    add_cp_args,
    add_model_args,
    check_cp_args,
    check_cpu_size,
    check_fake_side_streams,
    finite_float,
    int_list,
    positive_int,
    positive_int_list,
    scenario_from_args,
)

if TYPE_CHECKING:
    from dsv4cp.tools.checking import Scenario


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("check", help="compare CP=N with CP=1 on the tiny model (or a checkpoint)")
    add_cp_args(p)
    add_model_args(p)
    p.add_argument(
        "--lens", type=positive_int_list, default=(7, 130), help="prompt lengths, e.g. 7,130"
    )
    p.add_argument(
        "--prefix",
        type=int_list,
        default=(0,),
        help="cached prefix per prompt (prefilled first), e.g. 0,5",
    )
    p.add_argument("--chunk", type=int, default=0, help="chunked-prefill size (0 = one chunk)")
    p.add_argument(
        "--tol",
        type=finite_float(0.0, strict=False),
        default=1e-5,
        help="relative tolerance (fp32), a finite number >= 0",
    )
    p.add_argument(
        "--multistream",
        action="store_true",
        help="also run CP=N with the multistream executor (CUDA only)",
    )
    p.add_argument(
        "--graphs",
        action="store_true",
        help="also run CP=N replaying breakable CUDA graphs (CUDA only)",
    )
    p.add_argument(
        "--ep",
        action="store_true",
        help="also run CP=N with expert parallelism over the same N ranks (each holds "
        "n_routed_experts / N experts; N must divide it); compared with CP=1, EP=1",
    )
    p.add_argument(
        "--experts",
        type=positive_int,
        default=None,
        help="routed experts of the tiny random model (default 8; e.g. 12 for --cp 3 --ep)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def ep_scenario(args: argparse.Namespace, base: Scenario) -> Scenario:
    """The scenario with --experts applied; with --ep, checks that N divides the experts."""
    if args.experts is not None:
        if args.checkpoint is not None:
            raise UsageError("--experts changes the tiny random model; not with --checkpoint")
        if args.experts < base.config.num_experts_per_tok:
            raise UsageError(
                f"--experts {args.experts}: fewer than the {base.config.num_experts_per_tok} "
                "experts each token picks"
            )
        base = replace(base, config=replace(base.config, n_routed_experts=args.experts))
    if args.ep:
        n = base.config.n_routed_experts
        if not n:
            raise UsageError("--ep: the model has no routed experts (no MoE)")
        if n % args.cp:
            fits = [d for d in range(2, n + 1) if n % d == 0]
            raise UsageError(
                f"--ep: --cp {args.cp} does not divide the model's {n} routed experts (each rank "
                f"holds n_routed_experts / N); use --cp in {fits}"
                + (" or --experts" if args.checkpoint is None else "")
            )
    return base


def run(args: argparse.Namespace) -> int:
    from dsv4cp.tools.checking import compare, run_cp_scenario, run_scenario, summarize

    base = ep_scenario(args, scenario_from_args(args))
    backend = check_cp_args(args)
    check_fake_side_streams(args, backend)
    check_cpu_size(args, base.lens)
    log = sys.stderr if args.json else sys.stdout
    variants = [("serial", base)]
    for ms in [False, True] if args.multistream else [False]:
        for graphs in [False, True] if args.graphs else [False]:
            if ms or graphs:
                name = "+".join(n for n, on in (("multistream", ms), ("graphs", graphs)) if on)
                variants.append((name, replace(base, multistream=ms, graphs=graphs)))
    if args.ep:
        variants.append((f"ep={args.cp}", replace(base, ep=True)))
    steps = 1 + len(variants)  # the CP=1 reference, then each CP variant against it
    print(
        f"[1/{steps}] CP=1 reference: lens={list(base.lens)} prefix={list(base.prefix)} "
        f"chunk={base.chunk} device={base.device}",
        file=log,
        flush=True,
    )
    t0 = time.perf_counter()
    ref = run_scenario(base)
    reports = {}
    for step, (name, sc) in enumerate(variants, start=2):
        print(f"[{step}/{steps}] CP={args.cp} ({backend}, {name}) ...", file=log, flush=True)
        got, _ = run_cp_scenario(sc, args.cp, backend, timeout_s=args.timeout, check_order=True)
        # Graph replays record no per-layer rows: compare what both runs have.
        expected = {k: v for k, v in ref.items() if not sc.graphs or k in got}
        reports[name] = summarize(compare(expected, got), args.tol)
    ok = all(r["pass"] for r in reports.values())
    payload = {
        "cp": args.cp,
        "backend": backend,
        "lens": list(base.lens),
        "prefix": list(base.prefix),
        "chunk": base.chunk,
        "seed": base.seed,
        "ep": args.cp if args.ep else 1,
        "routed_experts": base.config.n_routed_experts,
        "device": base.device,
        "variants": reports,
        "pass": ok,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if args.json:
        print(json.dumps(payload, indent=2))
    else:
        for name, r in reports.items():
            print(
                f"\nCP={args.cp} vs CP=1 ({name}): {'PASS' if r['pass'] else 'FAIL'} "
                f"(tolerance {args.tol:g} relative)"
            )
            print(f"  {'layer':<10} {'max rel diff':>14}")
            for layer, v in r["layers_max_rel"].items():
                print(f"  {layer:<10} {v:>14.3e}")
            print(f"  {'logits':<10} {r['logits_max_rel']:>14.3e}")
            worst = max(r["caches_max_rel"].values(), default=0.0)
            print(f"  {'caches':<10} {worst:>14.3e}  top-k identical: {r['topk_identical']}")
    return 0 if ok else 1
