"""`dsv4cp cache-size`: what the attention caches of one request of N tokens take, per kind and
per token (`dsv4cp.cache.cache_bytes`; docs/caches.md).

The capacity planning before choosing CP and `--max-total-tokens`: caches are replicated on
every CP rank, so each GPU holds the whole figure.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from dsv4cp.commands.common import UsageError

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_SUFFIX = {"k": 1 << 10, "m": 1 << 20}


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "cache-size",
        help="bytes the attention caches of one request of N tokens take, per kind and token",
    )
    p.add_argument("--config", default="flash", help="'flash', 'tiny', or a config.json / dir")
    p.add_argument("--tokens", required=True, help="request length, e.g. 131072, 128K or 1M")
    p.add_argument("--quant", default="qat", help="qat (default: fp8/fp4 rows) or none (dense)")
    p.add_argument("--page-size", default="16", help="token slots per page (default 16)")
    p.add_argument(
        "--dtype", default="bf16", help="dense cache dtype under --quant none: bf16 or fp32"
    )
    p.add_argument(
        "--every-slot",
        action="store_true",
        help="every token slot keeps its SWA key and pair state (what a prefix cache that may "
        "resume at any position needs: the SGLang integration) instead of the window",
    )
    p.add_argument(
        "--swa-full-ratio",
        default=None,
        help="served through SGLang with hybrid SWA: SWA rows and pair state on SGLang's SWA pool "
        "of this share of the token slots (--swa-full-tokens-ratio; dsv4cp's default 0.1)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def _count(text: str, what: str) -> int:
    t = text.strip().lower()
    mult = _SUFFIX.get(t[-1:], 1)
    digits = t[:-1] if mult > 1 else t
    if not (digits.isascii() and digits.isdigit()):  # '²'.isdigit() is True, int('²') fails
        raise UsageError(
            f"{what} must be a non-negative integer (K/M suffix allowed), got {text!r}"
        )
    return int(digits) * mult


def _config(name: str) -> Any:
    from dsv4cp.config import DeepseekV41Config

    if name in ("flash", "tiny"):
        return getattr(DeepseekV41Config, name)()
    return DeepseekV41Config.from_hf(name)


def run(args: argparse.Namespace) -> int:
    from dsv4cp.cache import cache_bytes

    tokens = _count(args.tokens, "--tokens")
    page = _count(args.page_size, "--page-size")
    if page < 1:
        raise UsageError(f"--page-size must be >= 1, got {page}")
    if args.quant not in ("qat", "none"):
        raise UsageError(f"--quant must be qat or none, got {args.quant!r}")
    if args.dtype not in DTYPES:
        raise UsageError(f"--dtype must be bf16 or fp32, got {args.dtype!r}")
    ratio = None
    if args.swa_full_ratio is not None:
        if args.every_slot:
            raise UsageError("--swa-full-ratio and --every-slot are two different SWA layouts")
        try:
            ratio = float(args.swa_full_ratio)
        except ValueError:
            ratio = -1.0
        if not 0 < ratio <= 1:
            raise UsageError(f"--swa-full-ratio must be in (0, 1], got {args.swa_full_ratio!r}")
    try:
        config = _config(args.config)
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from None
    if page > config.max_position_embeddings:
        raise UsageError(
            f"--page-size {page:,} is larger than the model's context (max_position_embeddings "
            f"{config.max_position_embeddings:,})"
        )
    if tokens > config.max_position_embeddings:
        raise UsageError(
            f"--tokens {tokens:,} is longer than the model's context (max_position_embeddings "
            f"{config.max_position_embeddings:,})"
        )
    plan = cache_bytes(
        config,
        tokens,
        quant=args.quant,
        page_size=page,
        dtype=DTYPES[args.dtype],
        windowed=not args.every_slot,
        swa_full_ratio=ratio,
    )
    swa = "every slot" if args.every_slot else "window"
    if ratio is not None:
        swa = f"SGLang SWA pool, ratio {ratio:g}"
    report = {
        "config": args.config,
        "tokens": tokens,
        "quant": args.quant,
        "page_size": page,
        "swa": swa,
        "bytes_total": plan.total,
        "bytes_per_token": plan.per_token,
        "by_kind": plan.by_kind,
        "rows": plan.rows,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"caches of one request of {tokens} tokens ({args.config}, quant {args.quant}, page "
        f"{page}, SWA {report['swa']}; replicated on every CP rank)"
    )
    print(f"{'kind':<12} {'bytes':>16} {'per token':>12} {'rows':>12}")
    for kind, b in plan.by_kind.items():
        rows = plan.rows.get(kind)
        print(f"{kind:<12} {b:>16,} {b / max(tokens, 1):>12.2f} {'' if rows is None else rows:>12}")
    print(f"{'total':<12} {plan.total:>16,} {plan.per_token:>12.2f}")
    return 0
