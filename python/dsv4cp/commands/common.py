"""Argument parsing and checking shared by the subcommands.

Every input error is a `UsageError` (or an argparse error): `cli.main` prints it as one line,
`dsv4cp <command>: <message>`, and exits 2, never with a traceback. The checks run before any
work starts: devices that are absent, CP sizes a backend cannot run, sizes too large for the CPU
reference, outputs that cannot be written.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsv4cp.tools.checking import Scenario

SEED_LIMIT = 2**32  # seeds are in [0, 2**32)
# The CPU reference is O(n^2) per prompt of n tokens (the indexer scores every earlier entry):
# 8192^2 is one 8k-token prompt, about 12 s per pass on 2 cores; 16k tokens take about 45 s.
CPU_SIZE_LIMIT = 8192**2


class UsageError(ValueError):
    """A command-line input error: printed as one line and exit status 2."""


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers; an empty item (`5,,7`, `5,`) is an error, not skipped."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected at least one integer")
    items = text.split(",")
    if any(not v.strip() for v in items):
        raise argparse.ArgumentTypeError(f"empty item in {text!r}")
    try:
        return tuple(int(v) for v in items)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def positive_int_list(text: str) -> tuple[int, ...]:
    values = int_list(text)
    bad = [v for v in values if v < 1]
    if bad:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {bad[0]} in {text!r}")
    return values


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def seed_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= v < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"expected a seed in [0, 2**32), got {v}")
    return v


def finite_float(minimum: float, *, strict: bool) -> Callable[[str], float]:
    """An argparse type: a finite number >= minimum (> minimum when `strict`)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(v) or v < minimum or (strict and v == minimum):
            rel = ">" if strict else ">="
            raise argparse.ArgumentTypeError(f"expected a finite number {rel} {minimum}, got {v}")
        return v

    return parse


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
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model runs")
    p.add_argument("--seed", type=seed_int, default=0, help="in [0, 2**32) (default 0)")
    p.add_argument(
        "--timeout",
        type=finite_float(0.0, strict=True),
        default=60.0,
        help="seconds a rank waits for the others in a collective (default 60; see docs/cp.md)",
    )
    p.add_argument(
        "--debug-cp",
        action="store_true",
        help="the collective-order check on every rank and the ranks' full tracebacks when a "
        "CP run fails (what DSV4CP_DEBUG_CP=1 does)",
    )
    add_size_arg(p)


def add_size_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-large",
        action="store_true",
        help="run prompts larger than the CPU size limit anyway (minutes to hours)",
    )


def cp_backend(args: argparse.Namespace) -> str:
    if args.cp_backend:
        return str(args.cp_backend)
    return "nccl" if args.device == "cuda" else "gloo"


def check_device(args: argparse.Namespace) -> None:
    """--device cuda needs a GPU; --multistream and --graphs need --device cuda."""
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available")
    elif getattr(args, "multistream", False) or getattr(args, "graphs", False):
        raise UsageError("--multistream and --graphs need --device cuda")


def check_cp_args(args: argparse.Namespace) -> str:
    """The device, and the CP size against what the backend can run here; returns the backend."""
    from dsv4cp.cp.limits import check_cp_limit

    check_device(args)
    backend = cp_backend(args)
    if backend == "nccl" and args.device != "cuda":
        raise UsageError("--cp-backend nccl needs --device cuda")
    if args.cp > 1:
        try:
            check_cp_limit(args.cp, backend, who="--cp")
        except ValueError as e:
            raise UsageError(str(e)) from None
    return backend


def check_cpu_size(args: argparse.Namespace, lens: Sequence[int]) -> None:
    """Refuse prompts whose CPU reference would run for many minutes, unless --allow-large."""
    cost = sum(n * n for n in lens)
    if args.device == "cpu" and cost > CPU_SIZE_LIMIT and not args.allow_large:
        raise UsageError(
            f"--lens {','.join(map(str, lens))} is too large for the CPU reference: its cost "
            f"grows as the sum of squared prompt lengths ({cost:.3g} > {CPU_SIZE_LIMIT:.3g}, one "
            "8192-token prompt, about 12 s per pass on 2 cores); use --device cuda, shorter "
            "prompts, or --allow-large"
        )


def output_dir(path: str) -> Path:
    """`path` as a directory this process can write (created if missing), else a UsageError."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{path}: exists and is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{path}: cannot create the directory ({e.strerror or e})") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise UsageError(f"{path}: the directory is not writable")
    return p


def check_fake_side_streams(args: argparse.Namespace, backend: str) -> None:
    """Fake CP on CUDA: every rank (a thread) holds its own side streams, one per multistream
    lane and one to capture graphs; refuse up front (before the CP = 1 reference runs) when they
    cannot all be had."""
    if args.device != "cuda" or backend != "fake" or not (args.multistream or args.graphs):
        return
    from dsv4cp.config import DeepseekV41Config
    from dsv4cp.model import DeepseekV41Model
    from dsv4cp.side_streams import check_side_streams

    lanes = 0
    if args.multistream:
        lanes = len(DeepseekV41Model(DeepseekV41Config.tiny(), seed=None).prepare_lanes())
    per_rank = lanes + (1 if args.graphs else 0)
    flags = " ".join(
        f for f, on in (("--multistream", args.multistream), ("--graphs", args.graphs)) if on
    )
    check_side_streams(args.cp * per_rank, f"--cp {args.cp} (fake) with {flags}")


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


def scenario_from_args(args: argparse.Namespace, prefix: Sequence[int] | None = None) -> Scenario:
    """The `check` / `demo` scenario of the parsed flags (`prefix` overrides --prefix); a bad
    value, an unreadable checkpoint config or a dsv4cp export given as --checkpoint
    (`Scenario`'s ValueErrors) is a UsageError. (The weights load later, in `run_scenario`: a
    `CheckpointError` there is reported as one line too, by `cli.main`.)"""
    from dsv4cp.tools.checking import Scenario

    try:
        return Scenario(
            lens=args.lens,
            prefix=tuple(args.prefix if prefix is None else prefix),
            chunk=args.chunk,
            seed=args.seed,
            device=args.device,
            checkpoint=args.checkpoint,
            quant=args.quant,
        )
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from None
