"""Argument helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import sys


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def add_cp_args(p: argparse.ArgumentParser, default_cp: int = 2) -> None:
    p.add_argument(
        "--cp", type=positive_int, default=default_cp, help="CP ranks (default %(default)s)"
    )
    p.add_argument(
        "--cp-backend",
        choices=["gloo", "nccl", "fake"],
        default=None,
        help="gloo processes (CPU default), nccl processes (CUDA default, one GPU "
        "per rank) or fake (every rank as a thread of this process)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds a rank waits for the others in a collective",
    )
    p.add_argument(
        "--debug-cp",
        action="store_true",
        help="check that every rank issues the same collectives in the same order",
    )


def cp_backend(args: argparse.Namespace) -> str:
    if args.cp_backend:
        return args.cp_backend
    return "nccl" if args.device == "cuda" else "gloo"


def cuda_only_flags_ok(args: argparse.Namespace, command: str) -> bool:
    """--multistream and --graphs need --device cuda; prints why and returns False otherwise."""
    if (args.multistream or args.graphs) and args.device != "cuda":
        print(f"dsv4cp {command}: --multistream and --graphs need --device cuda", file=sys.stderr)
        return False
    return True
