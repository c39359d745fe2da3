"""The fused indexer node (`kernels/indexer_topk.py`: logits + running top-k, the logits never in
memory) at V4.1-Flash shapes, one run over its tile configurations, the shipped default first
as the baseline (the shipped route: at ≤ 8K keys a plain top-k takes the logits route, so there
the scan's variants, all run as `route=scan`, compare with `route=scan`'s row, not the first):
ms per call (CUDA events), the ratio to the baseline, and whether each configuration selects
exactly what the baseline selects (it must: the selection is exact). In
qat the shipped config also runs with `key_bits=32` (the running top-k's 32-step search, what
was shipped before the 16-step one for bf16 scores) and with `packed=False` (qat's bf16
roundings one value per instruction, what was shipped before the two-value inline PTX). The
running top-k's knobs run against it too: `row_group` 2 and 8 (rows cut at once), `cap` 2048
(fewer, larger cuts), `seed=off` (no seed: each piece's running top-k starts empty) and
`seed_stride` 64 and 256 (a denser or sparser sample than the planned one). `route=scan` and
`route=logits` time the plain top-k's two routes (`kernel.pick_route`: the shipped one is
picked by width and rows) on the index source, and in qat `route=logits/unpacked` the logits
route with its logits kernel's bf16 roundings one value per instruction (before §36);
`route=logits/fill` that route writing -inf past each row's visible keys (before §37);
`route=logits/bf16` in qat the route's logits on bf16 MMAs instead of int8 (before §40).
In qat `route=scan/int8` (every role) and `consumer=map/int8` (the consumer) time the scan with
its logits on int8 MMAs (`int8_scan=True`, opt-in, not yet timed; its head loop in the logits
kernel's cvt + relu_fma form, 348 SASS instructions a head step, the bf16 scan's 342), and
`…/int8-magic` with the other form (`indexer_logits_int8.SCAN_CONVERT = "magic"`,
`SCAN_RELU_FMA = False`: 439): A/B them against
`route=scan` and `consumer=map` of the same run. `--only` picks variants by name.

Roles, one request, a cold prefill of `--tokens` (random bf16 queries, keys and fp32 head
weights, in qat fake-fp4 queries and keys as the layer's; 32 heads × 128, top-k 512,
`--quant`), or with `--prefix P` that many rows after P
cached positions (one CP rank's rows of a chunk, e.g. `--tokens 2048 --prefix 126976`);
`--pieces 4,16` also times those width splits against the planned one: the ratio-2 index
source (plain top-k over T/2 entries), the ratio-1 candidate source (top-k and the 2048
published blocks of 8 over T entries), the ratio-1 candidate consumer (top-k among the source's
published blocks; shipped: `consumer="auto"` with the rows' mean visible keys, as the layer
calls it (`plan_gather`), and `consumer=map` / `consumer=gather` time each mode: score every
visible key, or gather the published blocks' keys).

    PYTHONPATH=python python -m benchmarks.indexer_scan --out out/indexer_scan.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.benchutil import Table, finish, time_cuda
from dsv4cp.kernels import indexer_logits_int8 as int8
from dsv4cp.kernels import indexer_topk as kernel
from dsv4cp.ops.attention_quant import fake_quant_index_fp4

# (BLOCK_T, BLOCK_N, warps, stages) tried against the shipped `kernel.DEFAULT_CONFIG`
CONFIGS = [(64, 128, 8, 2), (64, 64, 8, 2), (64, 64, 4, 2), (64, 64, 8, 3)]
HEADS, DIM, TOP_K, BLOCKS, BLOCK_SIZE = 32, 128, 512, 2048, 8


Variant = tuple[str, dict[str, Any]]  # (name, launch_mqa_topk keyword arguments)


def _roles(t: int, quant: str, prefix: int = 0) -> dict[str, Callable[[Variant], Any]]:
    """`t` query rows at positions prefix … prefix + t − 1 (one CP rank's rows: `--prefix`)."""
    g = torch.Generator(device="cuda").manual_seed(t + prefix)
    q = torch.randn(t, HEADS, DIM, device="cuda", generator=g).bfloat16()
    w = torch.randn(t, HEADS, device="cuda", generator=g) / HEADS
    k = torch.randn(prefix + t, DIM, device="cuda", generator=g).bfloat16()
    if quant == "qat":  # the layer's index q and k are fake-fp4 values there
        q, k = fake_quant_index_fp4(q).bfloat16(), fake_quant_index_fp4(k).bfloat16()
    pos = prefix + torch.arange(t, device="cuda")
    nv2, nv1 = ((pos + 1) // 2).to(torch.int32), (pos + 1).to(torch.int32)
    k2 = k[: (prefix + t) // 2]
    _, blocks = kernel.launch_mqa_topk(
        q, w, k, nv1, TOP_K, block_size=BLOCK_SIZE, max_blocks=BLOCKS, quant=quant
    )
    assert blocks is not None

    def run(keys: torch.Tensor, nv: torch.Tensor, v: Variant, **kw: Any) -> Any:
        knobs = dict(v[1])
        form = knobs.pop("int8_form", (int8.SCAN_CONVERT, int8.SCAN_RELU_FMA))
        shipped_form = int8.SCAN_CONVERT, int8.SCAN_RELU_FMA
        try:  # the scan's int8 head loop in another form (module constants, the same values)
            int8.SCAN_CONVERT, int8.SCAN_RELU_FMA = form
            return kernel.launch_mqa_topk(q, w, keys, nv, TOP_K, quant=quant, **knobs, **kw)
        finally:
            int8.SCAN_CONVERT, int8.SCAN_RELU_FMA = shipped_form

    mean_visible = float(nv1.double().mean())  # as the layer passes it (batch metadata)

    def consume(v: Variant) -> Any:
        return run(k, nv1, v, block_ids=blocks, block_size=BLOCK_SIZE, mean_visible=mean_visible)[0]

    return {
        "r2 index source": lambda v: run(k2, nv2, v)[0],
        "r1 candidate source": lambda v: run(k, nv1, v, block_size=BLOCK_SIZE, max_blocks=BLOCKS),
        "r1 candidate consumer": consume,
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b))
    return a is None and b is None or bool(torch.equal(a, b))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="16384", help="comma list of cold-prefill token counts")
    ap.add_argument(
        "--prefix", type=int, default=0, help="cached positions before the rows (a CP rank's)"
    )
    ap.add_argument("--pieces", default="", help="comma list of width splits to time as variants")
    ap.add_argument("--quant", choices=["qat", "none"], default="qat")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--only", default="", help="comma list of variant names (default all)")
    ap.add_argument("--roles", default="", help="comma list of role names (default all)")
    ap.add_argument("--out", default="out/indexer_scan.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("indexer_scan: needs a CUDA GPU", file=sys.stderr)
        return 2
    shipped = kernel.DEFAULT_CONFIG
    variants: list[Variant] = [("shipped", {"route": "auto"})]
    if args.quant == "qat":
        variants += [
            ("key_bits=32", {"key_bits": 32, "route": "scan"}),
            ("packed=False", {"packed": False, "route": "scan"}),
        ]
    variants += [(f"row_group={g}", {"row_group": g, "route": "scan"}) for g in (2, 8)]
    variants += [("cap=2048", {"cap": 2048, "route": "scan"})]
    variants += [("seed=off", {"seed_stride": 0, "route": "scan"})]
    variants += [(f"seed_stride={v}", {"seed_stride": v, "route": "scan"}) for v in (64, 256, 1024)]
    variants += [(f"config={c}", {"config": c, "route": "scan"}) for c in CONFIGS if c != shipped]
    variants += [
        (f"pieces={p}", {"pieces": int(p), "route": "scan"}) for p in args.pieces.split(",") if p
    ]
    variants += [("route=scan", {"route": "scan"}), ("route=logits", {"route": "logits"})]
    if args.quant == "qat":
        variants += [("route=logits/unpacked", {"route": "logits", "packed": False})]
    variants += [("route=logits/fill", {"route": "logits", "fill_logits": True})]
    if args.quant == "qat":
        variants += [("route=logits/bf16", {"route": "logits", "int8_logits": False})]
    variants += [(f"consumer={m}", {"consumer": m, "route": "scan"}) for m in ("map", "gather")]
    if args.quant == "qat":  # the scan on int8 MMAs (opt-in): against route=scan, consumer=map
        magic = {"int8_scan": True, "int8_form": ("magic", False)}
        variants += [("route=scan/int8", {"route": "scan", "int8_scan": True})]
        variants += [("route=scan/int8-magic", {"route": "scan", **magic})]
        variants += [("consumer=map/int8", {"consumer": "map", "route": "scan", "int8_scan": True})]
        variants += [("consumer=map/int8-magic", {"consumer": "map", "route": "scan", **magic})]
    if args.only:
        names = set(args.only.split(","))
        variants = [v for v in variants if v[0] in names or v[0] == "shipped"]
    table = Table(title=f"fused indexer node, {args.quant}, shipped config {shipped} first")
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        for t in (int(v) for v in args.tokens.split(",")):
            for role, run in _roles(t, args.quant, args.prefix).items():
                if args.roles and role not in args.roles.split(","):
                    continue
                base_ms, base_out = 0.0, None
                for variant in variants:
                    if variant[0].startswith("route=logits") and role != "r2 index source":
                        continue  # the logits route takes the plain top-k only
                    if variant[0].startswith("seed_stride") and "consumer" in role:
                        continue  # a consumer's selection takes no seed
                    if variant[0].startswith("consumer=") and "consumer" not in role:
                        continue  # the consumer's two modes
                    out = run(variant)
                    ms = time_cuda(lambda v=variant, f=run: f(v), warmup=2, iters=args.iters)
                    if base_out is None:
                        base_ms, base_out = ms["median_ms"], out
                    row = {
                        "tokens": t,
                        "prefix": args.prefix,
                        "role": role,
                        "variant": variant[0],
                        "shipped": variant == variants[0],
                        "ms": ms["median_ms"],
                        "shipped_over_this": base_ms / ms["median_ms"],
                        "equal_to_shipped": _same(out, base_out),
                    }
                    rows.append(row)
                    table.add(row)
                torch.cuda.empty_cache()
    table.print()
    return finish(
        args.out,
        {
            "benchmark": "indexer_scan",
            "quant": args.quant,
            "shapes": dict(heads=HEADS, dim=DIM, top_k=TOP_K, blocks=BLOCKS, block=BLOCK_SIZE),
            "shipped": list(shipped),
            "rows": rows,
        },
        all(r["equal_to_shipped"] for r in rows),
    )


if __name__ == "__main__":
    raise SystemExit(main())
