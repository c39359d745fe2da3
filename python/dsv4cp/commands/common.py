"""Argument helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsv4cp.tools.checking import Scenario


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


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--checkpoint / --quant: which model `check` and `demo` run."""
    p.add_argument(
        "--checkpoint",
        metavar="DIR",
        default=None,
        help="a released-format DeepSeek-V4.1 checkpoint (e.g. the tiny reference fixture); "
        "default: the tiny config with mHC and MoE, random weights",
    )
    p.add_argument(
        "--quant",
        choices=["none", "qat"],
        default="none",
        help="numerics: none (exact fp32/bf16) or qat (the reference's fp8/fp4 steps)",
    )


def scenario_from_args(args: argparse.Namespace, command: str) -> Scenario | None:
    """The `check` / `demo` scenario of the parsed flags; None (after saying why) if invalid."""
    from dsv4cp.tools.checking import Scenario

    try:
        return Scenario(
            lens=args.lens,
            prefix=args.prefix,
            chunk=args.chunk,
            seed=args.seed,
            device=args.device,
            checkpoint=args.checkpoint,
            quant=args.quant,
        )
    except (OSError, ValueError) as e:
        print(f"dsv4cp {command}: {e}", file=sys.stderr)
        return None
