"""The logits route's qat logits on int8 MMAs (`kernels/indexer_logits_int8`) against the bf16
kernel (`kernels/indexer_logits`, the baseline): ms per pass over the route's row chunks at the
ratio-2 index source's shapes (CUDA events), the ratio to the baseline with and without the
encoding of q and k, the visible-key TFLOP/s, and whether every visible logit equals the
baseline's bit for bit (it must: the int8 path is exact). `--tokens` as `T@P`: T rows at
positions P … P + T − 1 over (P + T) / 2 keys, fake-fp4 q and k (`fake_quant_index_fp4` of
random normals, as the layer's qat index vectors), fp32 head weights, 32 heads × 128,
n_visible (pos + 1) // 2; `fill=False` as the route launches it. Rows: the default (cvt,
relu_fma, 2 stages, 168 registers), the first int8 form (magic-number add, max then mul, 3
stages, no cap) and each knob alone: `cvt` (`cvt.rn.f32.s32` instead of the magic-number add),
`relu_fma` (the relu and the weight product in one `fma.rn.relu.bf16x2` a pair, the sign on the
head sum's FFMA), `maxnreg=168` (ptxas's register cap: 3 programs an SM, ~100 B spilled).

    PYTHONPATH=python python -m benchmarks.logits_int8 --tokens 65536@0 --out out/logits_int8.json
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from benchmarks.benchutil import Table, finish, time_cuda
from dsv4cp.kernels.indexer_logits import launch_mqa_logits
from dsv4cp.kernels.indexer_logits_int8 import DEFAULT_CONFIG, encode_int8, launch_mqa_logits_int8
from dsv4cp.ops.attention_quant import fake_quant_index_fp4
from dsv4cp.ops.indexer_topk import row_chunks

HEADS, DIM = 32, 128
FIRST: dict[str, Any] = {"convert": "magic", "relu_fma": False, "maxnreg": None}
CVT_FMA: dict[str, Any] = {"convert": "cvt", "relu_fma": True, "maxnreg": None}
VARIANTS: list[tuple[str, tuple[int, int, int, int], dict[str, Any]]] = [
    (f"int8 {DEFAULT_CONFIG} default", DEFAULT_CONFIG, {}),
    ("int8 (64, 128, 4, 3) magic (first form)", (64, 128, 4, 3), FIRST),
    ("int8 (64, 128, 4, 3) cvt", (64, 128, 4, 3), FIRST | {"convert": "cvt"}),
    ("int8 (64, 128, 4, 3) relu_fma", (64, 128, 4, 3), FIRST | {"relu_fma": True}),
    ("int8 (64, 128, 4, 3) cvt relu_fma", (64, 128, 4, 3), CVT_FMA),
    ("int8 (64, 128, 4, 2) cvt relu_fma", (64, 128, 4, 2), CVT_FMA),
    ("int8 (64, 128, 4, 2) magic maxnreg=168", (64, 128, 4, 2), FIRST | {"maxnreg": 168}),
]


def _case(t: int, prefix: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(t + prefix)
    q = fake_quant_index_fp4(torch.randn(t, HEADS, DIM, device="cuda", generator=g)).bfloat16()
    w = torch.randn(t, HEADS, device="cuda", generator=g) / HEADS
    k = torch.randn((prefix + t) // 2, DIM, device="cuda", generator=g)
    k = fake_quant_index_fp4(k).bfloat16()
    nv = ((prefix + torch.arange(t, device="cuda") + 1) // 2).to(torch.int32)
    return dict(q=q, w=w, k=k, nv=nv, rows=row_chunks(t, k.shape[0]), width=k.shape[0])


def _bf16(c: dict[str, Any]) -> list[torch.Tensor]:
    return [
        launch_mqa_logits(
            c["q"][r], c["w"][r], c["k"], c["nv"][r], width=c["width"], quant="qat", fill=False
        )  # fmt: skip
        for r in c["rows"]
    ]


def _int8(
    c: dict[str, Any], config: tuple[int, int, int, int], knobs: dict[str, Any]
) -> list[torch.Tensor]:
    k_enc = encode_int8(c["k"])  # once per pass, as the route does; q's per chunk
    kw: dict[str, Any] = dict(width=c["width"], fill=False, k_encoded=k_enc, config=config)
    return [
        launch_mqa_logits_int8(c["q"][r], c["w"][r], c["k"], c["nv"][r], **kw, **knobs)
        for r in c["rows"]
    ]


def _visible_equal(c: dict[str, Any], got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    cols = torch.arange(c["width"], device="cuda")[None, :]
    for r, a, b in zip(c["rows"], got, want):
        seen = cols < c["nv"][r][:, None]
        if not torch.equal(a[seen], b[seen]):
            return False
    return True


def _measure(c: dict[str, Any], t: int, prefix: int, iters: int) -> list[dict[str, Any]]:
    """One case's rows: the bf16 kernel first (the baseline), then the int8 configs."""
    flops = sum(int(c["nv"][r].double().sum().item()) for r in c["rows"]) * HEADS * DIM * 2
    want = _bf16(c)
    base = time_cuda(lambda: _bf16(c), warmup=1, iters=iters)["median_ms"]
    enc = time_cuda(lambda: (encode_int8(c["q"], c["w"]), encode_int8(c["k"])), warmup=1,
                    iters=iters)["median_ms"]  # fmt: skip
    rows = []
    for name, cfg, knobs in [("bf16 (baseline)", None, {})] + VARIANTS:
        if cfg is None:
            ms, equal = base, True
        else:
            equal = _visible_equal(c, _int8(c, cfg, knobs), want)
            ms = time_cuda(lambda g=cfg, v=knobs: _int8(c, g, v), warmup=1, iters=iters)
            ms = ms["median_ms"]
        rows.append({
            "tokens": t,
            "prefix": prefix,
            "width": c["width"],
            "chunks": len(c["rows"]),
            "variant": name,
            "ms": ms,
            "tflops": flops / ms / 1e9,
            "baseline_over_this": base / ms,
            "encode_ms": enc,
            "equal_to_baseline": equal,
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="16384@0,65536@0", help="T@P comma list")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="out/logits_int8.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("logits_int8: needs a CUDA GPU", file=sys.stderr)
        return 2
    table = Table(title="qat index logits: bf16 MMAs (baseline) against int8 MMAs")
    rows: list[dict[str, Any]] = []
    for spec in args.tokens.split(","):
        t, prefix = (int(v) for v in spec.split("@"))
        for row in _measure(_case(t, prefix), t, prefix, args.iters):
            rows.append(row)
            table.add(row)
        torch.cuda.empty_cache()
    table.print()
    payload = {
        "benchmark": "logits_int8",
        "dtype": "fake-fp4 q and k in bf16, fp32 logits (qat)",
        "shapes": dict(heads=HEADS, dim=DIM, variants=[(n, g, k) for n, g, k in VARIANTS]),
        "note": "int8 ms include the encoding of q (per chunk) and k (once a pass); encode_ms "
        "is both encodings of the whole batch timed alone",
        "rows": rows,
    }
    return finish(args.out, payload, all(r["equal_to_baseline"] for r in rows))


if __name__ == "__main__":
    raise SystemExit(main())
