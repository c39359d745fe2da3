"""`dsv4cp reference-check --checkpoint DIR --reference FILE [--cp N] [--chunk C] [--json]`:
teacher-forced blocks, index top-k and logits of a checkpoint against trusted reference outputs;
exit 1 on FAIL, 2 on bad input."""

from __future__ import annotations

import argparse
import json
import sys

from dsv4cp.commands.common import check_device, positive_int


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from dsv4cp.tools.reference_check import Criteria

    d = Criteria()
    p = sub.add_parser(
        "reference-check",
        help="validate a released-format checkpoint against reference outputs "
        "(teacher-forced blocks, index top-k, logits)",
    )
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="released-format checkpoint")
    p.add_argument(
        "--reference",
        required=True,
        metavar="FILE",
        help="reference outputs (safetensors; keys as in the tiny fixture's README)",
    )
    p.add_argument("--cp", type=positive_int, default=1, help="CP ranks (default %(default)s)")
    p.add_argument(
        "--cp-backend",
        choices=["fake", "gloo"],
        default="fake",
        help="fake: ranks as threads (default); gloo: one process per rank",
    )
    p.add_argument("--chunk", type=int, default=0, help="chunked-prefill size (0 = one chunk)")
    p.add_argument("--quant", choices=["qat", "none"], default="qat", help="numerics")
    p.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="model dtype"
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model runs")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per collective (CP)")
    p.add_argument("--ulps", type=float, default=d.ulps, help="bf16 ulps an element may differ")
    for flag, default, what in (
        ("--min-block-share", d.block_share, "tokens whose block output agrees within --ulps"),
        ("--min-topk-share", d.topk_share, "queries whose index top-k matches up to ties"),
        ("--max-logits-rms", d.logits_rms_rel, "largest relative rms difference of the logits"),
        ("--min-top1", d.logits_top1, "positions whose top-1 token matches"),
    ):
        what = f"share of {what}" if flag.startswith("--min") else what
        p.add_argument(flag, type=float, default=default, help=what)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    from dsv4cp.tools.reference_check import (
        CheckRun,
        Criteria,
        format_report,
        run_reference_check,
    )

    check_device(args)  # --device cuda without a GPU: one line, exit 2 (it was a traceback, exit 1)
    try:
        crit = Criteria(
            args.ulps, args.min_block_share, args.min_topk_share, args.max_logits_rms, args.min_top1
        )
        check = CheckRun(
            args.checkpoint,
            args.reference,
            cp=args.cp,
            backend=args.cp_backend,
            chunk=args.chunk,
            quant=args.quant,
            dtype=args.dtype,
            device=args.device,
            timeout_s=args.timeout,
        )
        report = run_reference_check(
            check, crit, progress=lambda s: print(s, file=sys.stderr, flush=True)
        )
    except (OSError, ValueError, NotImplementedError) as e:
        message = str(e).removeprefix("reference-check: ")  # the library's own prefix
        print(f"dsv4cp reference-check: {message}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["pass"] else 1
