"""`dsv4cp accuracy --base-url URL --model-path DIR`: server greedy output vs dsv4cp's runner."""

from __future__ import annotations

import argparse
import json

from dsv4cp.commands.common import positive_int


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "accuracy",
        help="compare a running server's greedy tokens and logprobs with dsv4cp's runner",
    )
    p.add_argument("--base-url", required=True, help="server URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--model-path", required=True, help="the checkpoint the server runs")
    p.add_argument("--max-new-tokens", type=positive_int, default=16)
    p.add_argument("--top-logprobs", type=positive_int, default=5, help="top-k logprobs compared")
    p.add_argument("--atol", type=float, default=1e-3, help="max |Δ logprob| (default %(default)s)")
    p.add_argument("--concurrency", type=positive_int, default=4, help="requests in flight")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="reference dtype (CPU)"
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    from dsv4cp.tools.accuracy import run_accuracy

    report = run_accuracy(
        args.base_url,
        args.model_path,
        max_new_tokens=args.max_new_tokens,
        top_k=args.top_logprobs,
        atol=args.atol,
        concurrency=args.concurrency,
        dtype=args.dtype,
        timeout_s=args.timeout,
    )
    print(json.dumps(report.to_json(), indent=2) if args.json else report.table())
    return 0 if report.passed else 1
