"""`dsv4cp` command line: demo, check, profile, export-tiny, accuracy, reference-check.

Each subcommand lives in `dsv4cp/commands/<name>_cmd.py` with `add_parser(subparsers)` and
`run(args) -> int`; this file only dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMANDS = {
    "demo": "dsv4cp.commands.demo_cmd",
    "check": "dsv4cp.commands.check_cmd",
    "profile": "dsv4cp.commands.profile_cmd",
    "export-tiny": "dsv4cp.commands.export_tiny_cmd",
    "accuracy": "dsv4cp.commands.accuracy_cmd",
    "reference-check": "dsv4cp.commands.reference_check_cmd",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsv4cp",
        description="DeepSeek-V4.1 prefill under context parallelism (CP), multistream and BCG.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        mod = importlib.import_module(module)
        p = mod.add_parser(sub)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
