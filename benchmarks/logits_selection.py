"""The logits route's selection (`kernels/topk.launch_topk` over the route's row chunks of qat
logits) at the ratio-2 index source's shapes: the pieces' search over int32 keys (`packed=False`,
the baseline, as shipped before §39) first, then the default (the search over bf16 pairs,
`kernels/topk_bf16x2`, at `slot_piece`'s width), the bf16-pair search at three piece widths and
the older stream merge: ms per pass over every chunk (CUDA events), the ratio to the baseline,
and whether each variant selects exactly what the baseline selects (it must: the selection is
exact). `--tokens` as `T@P`: T rows at positions P … P + T − 1 over (P + T) / 2 keys (random
bf16 queries and keys, fp32 head weights, 32 heads × 128, top-k 512, n_visible (pos + 1) // 2);
the logits are made once by the route's own logits kernel.

    PYTHONPATH=python python -m benchmarks.logits_selection --tokens 65536@0,49152@0 \
        --out out/logits_selection.json
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from benchmarks.benchutil import Table, finish, time_cuda
from dsv4cp.kernels.indexer_logits import launch_mqa_logits
from dsv4cp.kernels.topk import launch_topk
from dsv4cp.ops.indexer_topk import LOGITS_BUDGET_BYTES, row_chunks

HEADS, DIM, TOP_K = 32, 128, 512
VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("int32 keys (before)", {"packed": False}),
    ("default", {}),
    *[(f"bf16 pairs piece={p}", {"merge": "slots", "piece": p}) for p in (4096, 8192, 16384)],
    ("stream merge", {"merge": "stream"}),
]


def _case(t: int, prefix: int) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """The route's row chunks of qat logits (hidden entries unwritten, as the route leaves
    them) and their rows' visible counts; the width."""
    g = torch.Generator(device="cuda").manual_seed(t + prefix)
    q = torch.randn(t, HEADS, DIM, device="cuda", generator=g).bfloat16()
    w = torch.randn(t, HEADS, device="cuda", generator=g) / HEADS
    k = torch.randn((prefix + t) // 2, DIM, device="cuda", generator=g).bfloat16()
    nv = ((prefix + torch.arange(t, device="cuda") + 1) // 2).to(torch.int32)
    width = k.shape[0]
    rows = row_chunks(t, width)
    logits = [
        launch_mqa_logits(q[r], w[r], k, nv[r], width=width, quant="qat", fill=False) for r in rows
    ]
    return logits, [nv[r] for r in rows], width


def _select(
    chunks: tuple[list[torch.Tensor], list[torch.Tensor], int], kw: dict[str, Any]
) -> list[torch.Tensor]:
    """Every chunk's selection with `launch_topk`'s knobs `kw` (qat: key_bits 16)."""
    return [launch_topk(x, n, TOP_K, key_bits=16, **kw) for x, n in zip(chunks[0], chunks[1])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    tokens = "16384@0,65536@0,49152@0,16384@114688"
    ap.add_argument("--tokens", default=tokens, help="T@P comma list")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="out/logits_selection.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("logits_selection: needs a CUDA GPU", file=sys.stderr)
        return 2
    table = Table(title="the logits route's selection (key_bits 16), the int32 keys' search first")
    rows: list[dict[str, Any]] = []
    for spec in args.tokens.split(","):
        t, prefix = (int(v) for v in spec.split("@"))
        chunks = _case(t, prefix)
        width = chunks[2]
        base_ms, base_out = 0.0, None  # the first variant's (the baseline's)
        for name, kw in VARIANTS:
            out = _select(chunks, kw)
            base_out = out if base_out is None else base_out
            ms = time_cuda(lambda c=chunks, kw=kw: _select(c, kw), warmup=1, iters=args.iters)
            ms = ms["median_ms"]
            base_ms = base_ms or ms
            row = {
                "tokens": t,
                "prefix": prefix,
                "width": width,
                "chunks": len(chunks[0]),
                "variant": name,
                "ms": ms,
                "baseline_over_this": base_ms / ms,
                "equal_to_baseline": all(torch.equal(a, b) for a, b in zip(out, base_out)),
            }
            rows.append(row)
            table.add(row)
        del chunks
        torch.cuda.empty_cache()
    table.print()
    payload = {
        "benchmark": "logits_selection",
        "dtype": "qat logits (bf16 values in fp32)",
        "shapes": dict(heads=HEADS, dim=DIM, top_k=TOP_K, budget_bytes=LOGITS_BUDGET_BYTES),
        "rows": rows,
    }
    return finish(args.out, payload, all(r["equal_to_baseline"] for r in rows))


if __name__ == "__main__":
    raise SystemExit(main())
