"""`dsv4cp export-tiny DIR`: a servable tiny checkpoint (weights, config, tokenizer)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "export-tiny",
        help="write the tiny model as a checkpoint SGLang can serve (weights, config, tokenizer)",
    )
    p.add_argument("dir", help="output directory (created; existing files are overwritten)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default %(default)s)")
    return p


def run(args: argparse.Namespace) -> int:
    from dsv4cp.tools.export_tiny import export_tiny

    path = export_tiny(args.dir, seed=args.seed)
    print(f"wrote {path}")
    return 0
