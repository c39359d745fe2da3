"""`dsv4cp export-tiny DIR`: a servable tiny checkpoint (weights, config, tokenizer)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dsv4cp.commands.common import UsageError, output_dir, seed_int

# Weight files of another checkpoint: a loader would read them with (or instead of) ours.
WEIGHT_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "*.bin",
    "*.bin.index.json",
    "*.pt",
    "*.pth",
)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "export-tiny",
        help="write the tiny model as a checkpoint SGLang can serve (weights, config, tokenizer)",
    )
    p.add_argument(
        "dir",
        help="output directory (created; files export-tiny writes are overwritten; a directory "
        "holding another checkpoint's weights is refused unless --force)",
    )
    p.add_argument("--seed", type=seed_int, default=0, help="weight seed in [0, 2**32) (default 0)")
    p.add_argument(
        "--force",
        action="store_true",
        help="delete the weight files of another checkpoint found in DIR, then export",
    )
    return p


def foreign_weights(path: Path, ours: str) -> list[Path]:
    """Weight and index files in `path` that export-tiny does not write (`ours` it does)."""
    # a link too, dangling or looping: a loader's glob finds it and fails on it
    found = {f for p in WEIGHT_PATTERNS for f in path.glob(p) if f.is_file() or f.is_symlink()}
    return sorted(f for f in found if f.name != ours)


def run(args: argparse.Namespace) -> int:
    from dsv4cp.model import WEIGHTS_FILE
    from dsv4cp.tools.export_tiny import blocked_outputs, export_tiny

    path = output_dir(args.dir)
    blocked = blocked_outputs(path)
    if blocked:
        names = ", ".join(f.name for f in blocked)
        raise UsageError(
            f"{args.dir}: {names} {'is' if len(blocked) == 1 else 'are'} in the way (not a file): "
            "export-tiny writes a file there; move or delete it"
        )
    stale = foreign_weights(path, WEIGHTS_FILE)
    if stale and not args.force:
        names = ", ".join(f.name for f in stale[:4]) + (" …" if len(stale) > 4 else "")
        raise UsageError(
            f"{args.dir} holds another checkpoint's weights ({names}); a server would load them "
            "with or instead of the tiny model's: use an empty directory, or --force to delete them"
        )
    for f in stale:
        try:
            f.unlink()
        except OSError as e:
            raise UsageError(f"{f}: cannot delete it ({e.strerror or e})") from None
        print(f"removed {f}")
    export_tiny(path, seed=args.seed)
    print(f"wrote {path}")
    return 0
