"""`dsv4cp accuracy --base-url URL --model-path DIR [--reference FILE]`: a live server against
dsv4cp's runner on the same checkpoint and/or DeepSeek's reference outputs; exit 1 on FAIL."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from dsv4cp.commands.common import finite_float, positive_int


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "accuracy",
        help="compare a running server's greedy tokens and logprobs with dsv4cp's runner "
        "and/or reference outputs",
    )
    p.add_argument("--base-url", required=True, help="server URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--model-path", required=True, help="the checkpoint the server runs")
    p.add_argument(
        "--max-new-tokens", type=positive_int, default=16, help="greedy tokens per prompt"
    )
    p.add_argument("--top-logprobs", type=positive_int, default=5, help="top-k logprobs compared")
    p.add_argument(
        "--atol",
        type=finite_float(0.0, strict=False),
        default=1e-3,
        help="runner comparison: max |Δ logprob| (default %(default)s)",
    )
    p.add_argument("--concurrency", type=positive_int, default=4, help="requests in flight")
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="runner dtype on CPU (auto: bfloat16 for a released-format checkpoint, float32 "
        "for a dsv4cp export; use the server's --dtype)",
    )
    p.add_argument(
        "--quant",
        choices=["auto", "qat", "none"],
        default="auto",
        help="runner numerics (auto: qat for a checkpoint with a quantization_config, as the "
        "server's default)",
    )
    p.add_argument(
        "--timeout", type=finite_float(0.0, strict=True), default=300.0, help="seconds per request"
    )
    p.add_argument(
        "--reference",
        metavar="FILE",
        default=None,
        help="reference outputs (safetensors, keys as in the tiny fixture's README)",
    )
    p.add_argument(
        "--skip-runner",
        action="store_true",
        help="with --reference: do not compare with dsv4cp's runner",
    )
    p.add_argument(
        "--ref-min-top1",
        type=finite_float(0.0, strict=False),
        default=0.9,
        help="reference: min fraction of prompt positions with the same top-1",
    )
    p.add_argument(
        "--ref-max-rms",
        type=finite_float(0.0, strict=False),
        default=0.05,
        help="reference: max rms of (server - reference) logprobs, nats",
    )
    p.add_argument(
        "--ref-judge-decode",
        action="store_true",
        help="reference: fail when the decode steps' top-k rms exceeds --ref-max-rms (default: "
        "reported only; the fixture's decode logits are the reference's decode path)",
    )
    p.add_argument(
        "--ref-tie",
        type=finite_float(0.0, strict=False),
        default=0.05,
        help="reference: logprob gap (nats) under which two tokens are a tie",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    from dsv4cp.tools.accuracy import run_accuracy

    if args.skip_runner and not args.reference:
        print("dsv4cp accuracy: --skip-runner needs --reference FILE", file=sys.stderr)
        return 2
    reports: dict[str, Any] = {}
    try:
        if args.reference:
            from dsv4cp.tools.accuracy_reference import ReferenceTolerance, run_reference

            tol = ReferenceTolerance(
                args.ref_min_top1, args.ref_max_rms, args.ref_tie, args.ref_judge_decode
            )
            reports["reference"] = run_reference(
                args.base_url,
                args.reference,
                top_k=args.top_logprobs,
                tol=tol,
                timeout_s=args.timeout,
            )
        if not args.skip_runner:
            reports["runner"] = run_accuracy(
                args.base_url,
                args.model_path,
                max_new_tokens=args.max_new_tokens,
                top_k=args.top_logprobs,
                atol=args.atol,
                concurrency=args.concurrency,
                dtype=args.dtype,
                quant=args.quant,
                timeout_s=args.timeout,
                progress=lambda line: print(line, file=sys.stderr, flush=True),
            )
    except (
        OSError,
        ValueError,
        NotImplementedError,
    ) as e:  # missing checkpoint/tokenizer/reference, bad file
        print(f"dsv4cp accuracy: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({k: r.to_json() for k, r in reports.items()}, indent=2))
    else:
        print("\n\n".join(r.table() for r in reports.values()))
    return 0 if all(r.passed for r in reports.values()) else 1
