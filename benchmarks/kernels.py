"""Benchmark the Triton kernels beside their torch twins (dsv4cp.ops) and the peers on one GPU.

    PYTHONPATH=python python -m benchmarks.kernels --out out/kernels.json [--sweep] [--only mqa]

Sections: ceilings (bf16 GEMM, device copy), mqa (indexer logits), topk, attn (sparse attention
with sink; FlashMLA's sparse prefill as the peer when `flash_mla` imports), rows (fused SWA
store and the ratio-1/2 compressor), rope (the RoPE-only passes: the q tail, the index queries,
previous config vs default), workspace (FlashMLA's bf16 workspace over the caches: the rows'
numbering by the Triton `workspace_rows` kernels against their torch twins, the same decode),
writers (the layer's SWA rows, compressor and index keys, qat: the previous chain against the
fused writers that quantize and encode in their pass).
Every kernel row also records its max |kernel − twin|.
Compute rows give TFLOP/s and the fraction of the measured bf16 GEMM rate and of 790 TFLOP/s;
memory rows give GB/s over the bytes each op must move and the fraction of the measured copy rate
and of 4.3 TB/s. Times are medians of CUDA-graph replays timed with CUDA events (no Python
launch overhead; `eager_ms` where given is the plain call), warm L2 (inputs are reused).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from benchmarks import benchutil  # noqa: E402
from dsv4cp import ops, routing  # noqa: E402
from dsv4cp.kernels.attention import attention_flops  # noqa: E402
from dsv4cp.kernels.attention import launch_sparse_attention as attn_kernel  # noqa: E402
from dsv4cp.kernels.compressor import compress_entries, index_key  # noqa: E402
from dsv4cp.kernels.indexer_logits import launch_mqa_logits as mqa_kernel  # noqa: E402
from dsv4cp.kernels.norm_rope import norm_rope_rows  # noqa: E402
from dsv4cp.kernels.swa import store_swa_k  # noqa: E402
from dsv4cp.kernels.topk import launch_topk as topk_kernel  # noqa: E402
from dsv4cp.ops.rope import YarnScaling  # noqa: E402

NOMINAL_TFLOPS = 790.0
NOMINAL_GBPS = 4300.0
YARN = YarnScaling(16.0, 65536, 32.0, 1.0)
MQA_SWEEP = [(64, 128, 4, 2), (64, 128, 4, 3), (64, 256, 8, 3)]
ATTN_SWEEP = [(64, 8, 2), (64, 8, 3), (32, 8, 2)]
ROWS_SWEEP = [(4, 4), (8, 4), (16, 4), (16, 8), (32, 8)]
# narrow rows (RoPE tails, index queries): (rows per 512 columns, warps)
ROPE_SWEEP = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (8, 4)]
ROPE_PREVIOUS = (8, 4)  # the default for every width before 2026-12-03 (fourth session)

ROWS: list[dict[str, Any]] = []
CEIL = {"tflops": NOMINAL_TFLOPS, "gbps": NOMINAL_GBPS}
DEV = "cuda"
SWEEP = False
SMALL = False  # --smoke: tiny shapes on the CPU interpreter, to check this script itself


def mqa_topk(q, w, k, n_visible, k_top: int, *, max_logits_bytes: int) -> torch.Tensor:
    """topk_indices(mqa_logits(...)) in row chunks whose fp32 logits fit max_logits_bytes (rows
    are independent, so chunking does not change the result): the layer's logits → top-k step
    without its candidate blocks."""
    t, w_ = q.shape[0], k.shape[0]
    rows = max(1, min(t, max_logits_bytes // max(1, 4 * w_)))
    out = torch.empty((t, k_top), dtype=torch.int32, device=q.device)
    for a in range(0, t, rows):
        b = min(t, a + rows)
        logits = routing.mqa_logits(q[a:b], w[a:b], k, n_visible[a:b])
        out[a:b] = routing.topk_indices(logits, n_visible[a:b], k_top)
    return out


def _pick(real, small):
    return small if SMALL else real


def _ms(fn: Callable[[], object], iters: int = 20) -> float:
    """Median ms per call: CUDA-graph replays on the GPU (no launch overhead: what a captured
    prefill sees), eager calls where capture fails and on the CPU smoke run."""
    if DEV == "cuda":
        try:
            return benchutil.time_graph(fn, warmup=2, iters=iters)["median_ms"]
        except Exception as exc:  # not capturable: eager timing instead
            print(f"  (eager timing: {type(exc).__name__})", flush=True)
    return benchutil.time_cuda(fn, warmup=3, iters=iters)["median_ms"]


def _ms_eager(fn: Callable[[], object], iters: int = 20) -> float:
    return benchutil.time_cuda(fn, warmup=3, iters=iters)["median_ms"]


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    fin = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), fin):
        return float("nan")
    return (a[fin] - b[fin]).abs().max().item() if fin.any() else 0.0


def _row(
    op: str,
    impl: str,
    shape: str,
    dtype: str,
    ms: float,
    *,
    flops: float = 0.0,
    nbytes: float = 0.0,
    **extra: Any,
) -> None:
    row: dict[str, Any] = {"op": op, "impl": impl, "shape": shape, "dtype": dtype, "ms": ms}
    if flops:
        tf = flops / (ms * 1e-3) / 1e12
        row.update(tflops=tf, frac_measured=tf / CEIL["tflops"], frac_nominal=tf / NOMINAL_TFLOPS)
    if nbytes:
        gb = nbytes / (ms * 1e-3) / 1e9
        row.update(gbps=gb, frac_measured=gb / CEIL["gbps"], frac_nominal=gb / NOMINAL_GBPS)
    row.update(extra)
    ROWS.append(row)
    rate = f"{row['tflops']:7.1f} TFLOP/s" if flops else f"{row.get('gbps', 0):7.0f} GB/s"
    frac = row.get("frac_measured")
    note = " ".join(
        f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items()
    )
    print(
        f"{op:10s} {impl:28s} {shape:34s} {ms:9.4f} ms {rate}"
        f" {'' if frac is None else f'{frac:6.1%}'} {note}",
        flush=True,
    )


def bench_ceilings() -> None:
    m = _pick(8192, 256)
    a = torch.randn(m, m, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=DEV, dtype=torch.bfloat16)
    ms = _ms_eager(lambda: a @ b, iters=10)
    CEIL["tflops"] = 2 * m**3 / (ms * 1e-3) / 1e12
    src = torch.empty(_pick(2**30, 2**20), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms_copy = _ms_eager(lambda: dst.copy_(src), iters=10)  # a captured copy runs on the DMA engine
    CEIL["gbps"] = 2 * src.numel() / (ms_copy * 1e-3) / 1e9
    _row("ceiling", "torch bf16 matmul", f"{m}x{m}x{m}", "bf16", ms, flops=2 * m**3)
    _row(
        "ceiling",
        "device copy",
        f"{src.numel()} B read + written",
        "u8",
        ms_copy,
        nbytes=2 * src.numel(),
    )


def bench_mqa(sweep: bool) -> None:
    t, h, d, n = _pick((2048, 32, 128, 16384), (40, 4, 64, 300))
    q = torch.randn(t, h, d, device=DEV).bfloat16()
    w = torch.randn(t, h, device=DEV) / 64
    k = torch.randn(n, d, device=DEV).bfloat16()
    full = torch.full((t,), n, device=DEV)
    flops = 2.0 * t * n * h * d
    shape = f"T={t} H_I={h} D_I={d} N={n} full"
    ref = ops.mqa_logits(q, w, k, full)
    _row(
        "mqa",
        "ops twin (fp32 per head)",
        shape,
        "bf16->fp32",
        _ms(lambda: ops.mqa_logits(q, w, k, full), 5),
        flops=flops,
    )

    def sglang_torch() -> torch.Tensor:  # SGLang 0.5.23's Hopper path: bf16 einsum + relu + sum
        s = torch.einsum("thd,nd->thn", q, k).relu_()
        return (s * w.bfloat16()[:, :, None]).sum(1).float()

    _row("mqa", "torch bf16 einsum (SGLang)", shape, "bf16", _ms(sglang_torch, 5), flops=flops)
    configs = MQA_SWEEP if sweep else [None]
    best = None
    for cfg in configs:
        out = mqa_kernel(q, w, k, full, config=cfg)
        ms = _ms(lambda cfg=cfg: mqa_kernel(q, w, k, full, config=cfg))
        _row(
            "mqa",
            f"triton {cfg or 'default'}",
            shape,
            "bf16->fp32",
            ms,
            flops=flops,
            maxdiff=_maxdiff(out, ref),
        )
        best = ms if best is None else min(best, ms)
    # Causal rows after a prefix (P = N - T): FLOPs count only visible keys.
    causal = torch.arange(t, device=DEV) + (n - t) + 1
    vis_flops = 2.0 * h * d * causal.sum().item()
    _row(
        "mqa",
        "triton default, causal",
        f"T={t} H_I={h} N={n} P={n - t}",
        "bf16->fp32",
        _ms(lambda: mqa_kernel(q, w, k, causal)),
        flops=vis_flops,
        flops_counted="visible",
    )
    ks = torch.zeros(t, dtype=torch.long, device=DEV)
    ks[t // 2 + 7 :] = 3  # two requests: one mixed row block goes through the per-row kernel
    nv = torch.full((t,), n - 3, device=DEV)
    _row(
        "mqa",
        "triton default, 2 requests",
        shape,
        "bf16->fp32",
        _ms(lambda: mqa_kernel(q, w, k, nv, k_start=ks, width=n)),
        flops=flops,
    )
    # The indexer step as the runner calls it: logits in row chunks under a budget, then top-k.
    n_long = _pick(65536, 600)
    k_long = torch.randn(n_long, d, device=DEV).bfloat16()
    nv_long = torch.arange(t, device=DEV) + (n_long - t) + 1
    budget = 256 << 20
    _row(
        "mqa+topk",
        "mqa_topk (256 MiB chunks)",
        f"T={t} N={n_long} k=512",
        "bf16",
        _ms(lambda: mqa_topk(q, w, k_long, nv_long, _pick(512, 16), max_logits_bytes=budget), 5),
        flops=2.0 * h * d * nv_long.sum().item(),
        flops_counted="visible (logits only)",
    )


def bench_topk() -> None:
    shapes = ((2048, 16384, 512), (2048, 16384, 1024), (512, 65536, 512), (512, 131072, 1024))
    for t, w, k in _pick(shapes, ((8, 300, 16), (4, 20000, 8))):
        _topk_case(t, w, k)


def _topk_case(t: int, w: int, k: int, pieces: tuple[int, ...] = (8192,)) -> None:
    logits = torch.randn(t, w, device=DEV).bfloat16().float()
    nv = torch.full((t,), w, device=DEV)
    shape = f"T={t} W={w} k={k}"
    nbytes = 4.0 * t * w
    ref = ops.topk_indices(logits, nv, k)
    _row(
        "topk",
        "ops twin (exact ties)",
        shape,
        "fp32",
        _ms(lambda: ops.topk_indices(logits, nv, k)),
        nbytes=nbytes,
    )
    _row(
        "topk",
        "torch.topk + sort",
        shape,
        "fp32",
        _ms(lambda: logits.topk(k, dim=-1, sorted=False).indices.sort(-1)),
        nbytes=nbytes,
    )
    out = topk_kernel(logits, nv, k)
    _row(
        "topk",
        "triton",
        shape,
        "fp32",
        _ms(lambda: topk_kernel(logits, nv, k)),
        nbytes=nbytes,
        equal_to_twin=bool(torch.equal(out, ref)),
        eager_ms=_ms_eager(lambda: topk_kernel(logits, nv, k)),
    )
    if w > _pick(16384, 4096):
        for piece in pieces:
            out = topk_kernel(logits, nv, k, piece=_pick(piece, 1024))
            _row(
                "topk",
                f"triton piece={piece}",
                shape,
                "fp32",
                _ms(lambda piece=piece: topk_kernel(logits, nv, k, piece=_pick(piece, 1024))),
                nbytes=nbytes,
                equal_to_twin=bool(torch.equal(out, ref)),
            )


def bench_attention(sweep: bool) -> None:
    t, h, d, n, kk = _pick((4096, 64, 512, 20480, 640), (4, 16, 64, 100, 80))
    q = torch.randn(t, h, d, device=DEV).bfloat16()
    kv = torch.randn(n, d, device=DEV).bfloat16()
    idx = torch.randint(0, n, (t, kk), device=DEV, dtype=torch.int32)
    sink = torch.randn(h, device=DEV)
    scale = d**-0.5
    flops = attention_flops(t, h, kk, d, d)
    shape = f"T={t} H={h} D={d} K={kk} N={n}"
    ref = ops.sparse_attention(q, kv, idx, sink, scale)
    _row(
        "attn",
        "ops twin (gather+einsum)",
        shape,
        "bf16",
        _ms(lambda: ops.sparse_attention(q, kv, idx, sink, scale), 5),
        flops=flops,
    )
    for cfg in ATTN_SWEEP if sweep else [None]:
        out = attn_kernel(q, kv, idx, sink, scale, config=cfg)
        ms = _ms(lambda cfg=cfg: attn_kernel(q, kv, idx, sink, scale, config=cfg))
        _row(
            "attn",
            f"triton {cfg or 'default'}",
            shape,
            "bf16",
            ms,
            flops=flops,
            maxdiff=_maxdiff(out, ref),
        )
    # V4.1-like rows: early rows see few top-k entries (-1 elsewhere).
    top = kk - _pick(128, 16)
    p = torch.arange(t, device=DEV) * 4
    mask = torch.arange(top, device=DEV)[None, :] <= p[:, None]
    idx_v41 = torch.cat([torch.where(mask, idx[:, :top], -1), idx[:, top:]], 1).contiguous()
    ms = _ms(lambda: attn_kernel(q, kv, idx_v41, sink, scale))
    valid = (idx_v41 >= 0).sum().item()
    _row(
        "attn",
        "triton default, V4.1 -1 rows",
        shape,
        "bf16",
        ms,
        flops=2.0 * h * valid * 2 * d,
        flops_counted="valid indices",
    )
    try:
        import flash_mla
    except Exception as exc:  # the peer is optional
        print(f"flash_mla unavailable: {exc!r}")
        return
    kv3, idx3 = kv[:, None, :], idx[:, None, :]

    def peer() -> torch.Tensor:
        return flash_mla.flash_mla_sparse_fwd(
            q, kv3, idx3, scale, d, attn_sink=sink, use_legacy=True
        )[0]

    out = peer()
    _row(
        "attn",
        "FlashMLA sparse_fwd (legacy)",
        shape,
        "bf16",
        _ms(peer),
        flops=flops,
        maxdiff=_maxdiff(out, ref),
    )
    idx3b = idx_v41[:, None, :]
    _row(
        "attn",
        "FlashMLA, V4.1 -1 rows",
        shape,
        "bf16",
        _ms(
            lambda: flash_mla.flash_mla_sparse_fwd(
                q, kv3, idx3b, scale, d, attn_sink=sink, use_legacy=True
            )[0]
        ),
        flops=2.0 * h * valid * 2 * d,
        flops_counted="valid indices",
    )


def bench_rows() -> None:
    d, dr = _pick((512, 64), (96, 32))
    wgt = torch.rand(d, device=DEV) + 0.5
    for t in _pick((8192, 131072), (9,)):
        _swa_case(t, d, dr, wgt)
    for n in _pick((4096, 65536), (7,)):
        _compress_case(n, d, dr, wgt)


def _swa_case(t: int, d: int, dr: int, wgt: torch.Tensor) -> None:
    x = torch.randn(t, d, device=DEV).bfloat16()
    pos = torch.randint(0, 1 << 17, (t,), device=DEV)
    slots = torch.randperm(2 * t, device=DEV)[:t]
    cache = torch.zeros(2 * t, d, device=DEV, dtype=torch.bfloat16)
    ref = cache.clone()
    ops.store_swa_k(x, pos, slots, ref, wgt, 1e-20, dr, 10000.0, None)
    store_swa_k(x, pos, slots, cache, wgt, 1e-20, dr, 10000.0, None)
    nbytes = 2.0 * t * d * 2 + 16.0 * t
    shape = f"T={t} D={d} rope={dr}"
    _row(
        "swa_store",
        "ops twin",
        shape,
        "bf16",
        _ms(lambda: ops.store_swa_k(x, pos, slots, ref, wgt, 1e-20, dr, 10000.0, None)),
        nbytes=nbytes,
    )
    _row(
        "swa_store",
        "triton fused",
        shape,
        "bf16",
        _ms(lambda: store_swa_k(x, pos, slots, cache, wgt, 1e-20, dr, 10000.0, None)),
        nbytes=nbytes,
        maxdiff=_maxdiff(cache, ref),
        eager_ms=_ms_eager(lambda: store_swa_k(x, pos, slots, cache, wgt, 1e-20, dr, 1e4, None)),
    )
    for cfg in ROWS_SWEEP if SWEEP and t > _pick(8192, 1) else []:

        def run(cfg: tuple[int, int] = cfg) -> None:
            norm_rope_rows(
                x,
                cache,
                positions=pos,
                rope_dim=dr,
                theta=1e4,
                yarn=None,
                norm_weight=wgt,
                eps=1e-20,
                slots=slots,
                config=cfg,
            )

        _row("swa_store", f"triton rows/warps {cfg}", shape, "bf16", _ms(run), nbytes=nbytes)


def bench_rope() -> None:
    """The RoPE-only passes at Flash shapes: the q tail in place ([T, 64 heads, 512], rope 64:
    after wq_b and, inverse, on the attention output) and the index queries ([T, 32 × 128],
    qat: rope then fp4 per 32). Rows: the ops twin, the kernel at its previous config and at
    its default (`norm_rope.default_config`), each with its ratio to the previous config."""
    t, h, d, dr, hi, di = _pick((16384, 64, 512, 64, 32, 128), (8, 4, 96, 32, 2, 64))
    pos = torch.arange(t, device=DEV) + _pick(100000, 5)
    q = torch.randn(t, h, d, device=DEV).bfloat16()
    tail = q.view(-1, d)[:, d - dr :]
    pe = pos[:, None].expand(-1, h).reshape(-1)
    nbytes = 2.0 * tail.numel() * 2
    shape = f"T={t} H={h} D={d} rope={dr}"
    ref = ops.rope_tail_(q.clone(), pos, dr, 1e4, YARN)  # the timed calls rotate q in place
    qk = routing.rope_tail_(q.clone(), pos, dr, 1e4, YARN)

    def tail_kernel(cfg: tuple[int, int] | None) -> None:
        norm_rope_rows(
            tail, tail, positions=pe, rope_dim=dr, theta=1e4, yarn=YARN, norm=False, config=cfg
        )

    _row("rope_tail", "ops twin", shape, "bf16", _ms(lambda: ops.rope_tail_(q, pos, dr, 1e4, YARN)),
         nbytes=nbytes)  # fmt: skip
    _rope_configs("rope_tail", shape, nbytes, tail_kernel, maxdiff=_maxdiff(qk, ref))
    qp = torch.randn(t, hi * di, device=DEV).bfloat16()
    out = torch.empty(t * hi, di, device=DEV, dtype=torch.bfloat16)
    pi = pos.repeat_interleave(hi)
    shape_i = f"T={t} H_I={hi} D={di} rope={dr} qat"
    nbytes_i = 2.0 * qp.numel() * 2
    ref_i = ops.rope_index_queries(qp, pos, dr, 1e4, YARN, head_dim=di, quant="qat")
    got_i = routing.rope_index_queries(qp, pos, dr, 1e4, YARN, head_dim=di, quant="qat")

    def index_kernel(cfg: tuple[int, int] | None) -> None:
        norm_rope_rows(
            qp.view(-1, di), out, positions=pi, rope_dim=dr, theta=1e4, yarn=YARN, norm=False,
            fake_quant="fp4", config=cfg,
        )  # fmt: skip

    _row(
        "rope_idx_q",
        "ops twin",
        shape_i,
        "bf16",
        _ms(lambda: ops.rope_index_queries(qp, pos, dr, 1e4, YARN, head_dim=di, quant="qat")),
        nbytes=nbytes_i,
    )
    _rope_configs("rope_idx_q", shape_i, nbytes_i, index_kernel, maxdiff=_maxdiff(got_i, ref_i))


def bench_workspace() -> None:
    """`flashmla.build_workspace` for one index layer's chunk at Flash shapes: 16K queries, the
    SWA window (128 per row) over the chunk's SWA rows and the top-k (512 per row) over a ratio-2
    cache of 8K entries, qat formats; the rows' numbering by the Triton kernels (shipped) and by
    their torch twins (`ops.workspace_rows`: marks by `scatter_reduce`, not the `index_fill_`
    into a sink row that the CUDA path ran before the kernels), same decode, same outputs."""
    from dsv4cp.kernels import flashmla
    from dsv4cp.ops import workspace_rows as ops_rows
    from dsv4cp.ops.kv_format import encode_rows

    t, n_swa, n_comp, d = _pick((16384, 16384, 8192, 512), (8, 24, 16, 64))
    win, top = _pick((128, 512), (8, 16))
    gen = torch.Generator(device=DEV).manual_seed(0)
    swa = encode_rows(torch.randn(n_swa, d, device=DEV), "fp8_ue8m0_32", dense_dtype=torch.bfloat16)
    comp = encode_rows(
        torch.randn(n_comp, d, device=DEV), "fp8_ue8m0_32", dense_dtype=torch.bfloat16
    )
    rows = torch.arange(t, device=DEV)[:, None]
    swa_idx = (rows - torch.arange(win, device=DEV)[None, :]).clamp(min=-1).int()
    comp_idx = torch.randint(0, n_comp, (t, top), device=DEV, generator=gen).int()
    comp_idx = torch.where(comp_idx > rows // 2, -1, comp_idx)
    src = flashmla.workspace_sources(swa, swa_idx, comp, comp_idx, "fp8_ue8m0_32", "fp8_ue8m0_32",
                                     (n_swa, n_comp))  # fmt: skip

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        return flashmla.build_workspace(src, slice(0, t), d, torch.bfloat16)

    shape = f"T={t} K={win}+{top} N={n_swa}+{n_comp} D={d}"
    kv, idx = run()
    ms_kernel = _ms(run)
    saved = flashmla.k_rows
    flashmla.k_rows = ops_rows  # type: ignore[assignment] # the same functions, in torch
    try:
        kv_t, idx_t = run()
        ms_twin = _ms(run)
    finally:
        flashmla.k_rows = saved
    same = bool(torch.equal(idx, idx_t)) and bool(
        torch.equal(kv[idx[idx >= 0].long()], kv_t[idx_t[idx_t >= 0].long()])
    )
    nbytes = 4.0 * (swa_idx.numel() + comp_idx.numel()) * 3  # indices read twice, written once
    _row("workspace", "ops twins (torch numbering)", shape, "int32", ms_twin, nbytes=nbytes)
    _row("workspace", "kernels (shipped)", shape, "int32", ms_kernel, nbytes=nbytes,
         twin_over_kernel=ms_twin / ms_kernel, same_output=same)  # fmt: skip


def _rope_configs(
    op: str, shape: str, nbytes: float, run: Callable[[tuple[int, int] | None], None], **extra: Any
) -> None:
    prev = _ms(lambda: run(ROPE_PREVIOUS))
    _row(op, f"triton previous {ROPE_PREVIOUS}", shape, "bf16", prev, nbytes=nbytes)
    now = _ms(lambda: run(None))
    _row(op, "triton default", shape, "bf16", now, nbytes=nbytes, previous_over_this=prev / now,
         **extra)  # fmt: skip
    for cfg in ROPE_SWEEP if SWEEP else []:
        ms = _ms(lambda cfg=cfg: run(cfg))
        _row(op, f"triton rows/warps {cfg}", shape, "bf16", ms, nbytes=nbytes,
             previous_over_this=prev / ms)  # fmt: skip


def _compress_case(n: int, d: int, dr: int, wgt: torch.Tensor) -> None:
    comp = torch.randn(n, 2 * d, device=DEV)
    state = (torch.randn(n, d, device=DEV), torch.randn(n, d, device=DEV))
    pos = torch.arange(n, device=DEV) * 2
    rows = torch.arange(n, device=DEV)
    read = torch.where(rows == 0, 1, -1)
    write = torch.where(rows % 2 == 0, rows, -1)
    slots = torch.randperm(2 * n, device=DEV)[:n]
    cache = torch.zeros(2 * n, d, device=DEV, dtype=torch.bfloat16)
    ref = cache.clone()
    shape = f"n={n} D={d} rope={dr}"
    args = (read, write, wgt, 1e-20, torch.bfloat16, pos, slots)
    nbytes = 4.0 * n * d * 2 + 2.0 * n * d * 2 + 4.0 * n * d + 24.0 * n

    def twin_r2() -> torch.Tensor:
        return ops.compress_entries(comp, state, *args, ref, "dense", dr, 160000.0, YARN)

    def fused_r2() -> torch.Tensor:
        return compress_entries(comp, state, *args, cache, "dense", dr, 160000.0, YARN)

    ref_lat, lat = twin_r2(), fused_r2()
    _row("compress2", "ops twin", shape, "fp32->bf16", _ms(twin_r2), nbytes=nbytes)
    _row("compress2", "triton fused", shape, "fp32->bf16", _ms(fused_r2), nbytes=nbytes,
         maxdiff=max(_maxdiff(lat, ref_lat), _maxdiff(cache, ref)))  # fmt: skip
    kvb = comp[:, :d].bfloat16()
    nbytes1 = 2.0 * n * d + 2.0 * n * d * 2 + 16.0 * n
    args1 = (None, None, None, wgt, 1e-20, torch.bfloat16, pos, slots)

    def twin_r1() -> torch.Tensor:
        return ops.compress_entries(kvb, *args1, ref, "dense", dr, 160000.0, YARN)

    def fused_r1() -> torch.Tensor:
        return compress_entries(kvb, *args1, cache, "dense", dr, 160000.0, YARN)

    _row("compress1", "ops twin", shape, "bf16", _ms(twin_r1), nbytes=nbytes1)
    _row("compress1", "triton fused", shape, "bf16", _ms(fused_r1), nbytes=nbytes1)
    wk = (torch.randn(128, d, device=DEV) / 20).bfloat16()
    kn = torch.rand(128, device=DEV) + 0.5
    latb = lat.contiguous()
    ref_ik = ops.index_key(latb, wk, kn, 1e-20, pos, dr, 160000.0, YARN)
    _row(
        "index_key",
        "ops twin",
        f"n={n} {d}->128",
        "bf16",
        _ms(lambda: ops.index_key(latb, wk, kn, 1e-20, pos, dr, 160000.0, YARN)),
    )
    out = index_key(latb, wk, kn, 1e-20, pos, dr, 160000.0, YARN)
    _row(
        "index_key",
        "cuBLAS + triton norm/rope",
        f"n={n} {d}->128",
        "bf16",
        _ms(lambda: index_key(latb, wk, kn, 1e-20, pos, dr, 160000.0, YARN)),
        maxdiff=_maxdiff(out, ref_ik),
    )


def bench_writers() -> None:
    """The layer's cache writers at Flash shapes, qat (16K gathered rows, D 512, rope 64, index
    keys 128): the chain the layer ran before the fused writers (the row kernels one step each,
    torch's quantizers and stores, pair partners by cat / gather / where, non-emitting rows into
    the dummy row) against `swa_key_rows`, `compress_entries` + `store_index_keys`. Both write
    the same cache rows. `codes_equal` is the share of emitted rows with identical bytes,
    `values_equal` the share whose decoded values are identical: the previous SWA chain
    quantized the fake-fp8 key a second time, which halves a block's scale (and doubles its
    codes) where the block's top code had rounded to 224, so its bytes differ, not its values."""
    from dsv4cp.kernels import compressor as kc
    from dsv4cp.kernels import swa as ks
    from dsv4cp.ops.kv_format import decode_rows, encode_rows, row_width

    t, d, dr, di = _pick((16384, 512, 64, 128), (12, 64, 16, 32))
    bf, u8 = torch.bfloat16, torch.uint8
    x = torch.randn(t, d, device=DEV).bfloat16()
    pos = torch.arange(t, device=DEV) + 4096
    w = (torch.rand(d, device=DEV) + 0.5).bfloat16()
    swa_prev = lambda: encode_rows(  # noqa: E731
        ks.swa_key(x, pos, w, 1e-6, dr, 1e4, YARN, bf, "qat"), "fp8_ue8m0_32", dense_dtype=bf
    )
    swa_new = lambda: ks.swa_key_rows(  # noqa: E731
        x, pos, w, 1e-6, dr, 1e4, YARN, "qat", "fp8_ue8m0_32", u8
    )
    a, b = swa_prev(), swa_new()
    same = (a == b).all(1).float().mean().item()
    fmt = "fp8_ue8m0_32"
    values = (decode_rows(a, fmt, d) == decode_rows(b, fmt, d)).all(1).float().mean().item()
    shape = f"T={t} D={d} rope={dr}"
    nbytes = 2.0 * t * d + t * row_width("fp8_ue8m0_32", d)
    prev_ms, new_ms = _ms(swa_prev), _ms(swa_new)
    _row("swa_rows", "previous: kernel + torch encode", shape, "bf16->fp8", prev_ms, nbytes=nbytes)
    _row("swa_rows", "fused encode (shipped)", shape, "bf16->fp8", new_ms, nbytes=nbytes,
         previous_over_this=prev_ms / new_ms, codes_equal=same, values_equal=values)  # fmt: skip
    for ratio in (2, 1):
        _writers_case(ratio, t, d, dr, di, kc)


def _writers_case(ratio: int, t: int, d: int, dr: int, di: int, kc: Any) -> None:
    from dsv4cp.ops.kv_format import decode_rows, encode_rows, row_width

    bf = torch.bfloat16
    cf, xf = "fp4_e4m3_16", "fp4_ue8m0_32"
    rows = torch.arange(t, device=DEV)
    pos = rows + 4096  # one request's chunk at 4096: row 0 is its first token (even)
    w = (torch.rand(d, device=DEV) + 0.5).bfloat16()
    wk = (torch.randn(di, d, device=DEV) / 20).bfloat16()
    kn = (torch.rand(di, device=DEV) + 0.5).bfloat16()
    n_ent = t // ratio + 8
    emits = (pos + 1) % ratio == 0
    emit = torch.where(emits, (pos + 1) // ratio - 1 - 4096 // ratio + 1, -1)  # row 0: dummy
    emit_dummy = emit.clamp(min=0)
    entry_pos = ((pos + 1) // ratio - 1).clamp(min=0) * ratio
    if ratio == 2:
        comp = torch.randn(t, 2 * d, device=DEV)
        state = (torch.randn(t + 1, d, device=DEV), torch.randn(t + 1, d, device=DEV))
        read = torch.where(rows == 0, t, -1)
        write = torch.where(pos % 2 == 0, rows + 1, -1)  # state row 0: the dummy
        first = (rows == 0)[:, None]
    else:
        comp = torch.randn(t, d, device=DEV).bfloat16()
    caches = [
        (torch.zeros(n_ent, row_width(cf, d), device=DEV, dtype=torch.uint8),
         torch.zeros(n_ent, row_width(xf, di), device=DEV, dtype=torch.uint8))
        for _ in range(2)
    ]  # fmt: skip

    def previous() -> None:
        ccache, icache = caches[0]
        if ratio == 2:
            kv, gate = comp[:, :d], comp[:, d:]
            rd = read.clamp(min=0)
            partner_kv = torch.where(first, state[0][rd], torch.cat([kv[:1], kv[:-1]]))
            partner_gate = torch.where(first, state[1][rd], torch.cat([gate[:1], gate[:-1]]))
            pooled = kc.pair_pool(kv, gate, partner_kv, partner_gate)
            state[0][write.clamp(min=0)] = kv
            state[1][write.clamp(min=0)] = gate
        else:
            pooled = comp
        lat = kc.compressed_latent(pooled, w, 1e-6, bf)
        key = kc.compressed_key(lat, entry_pos, dr, 1e4, YARN)
        ccache[emit_dummy] = encode_rows(key, cf, dense_dtype=bf)
        ikey = kc.index_key(lat, wk, kn, 1e-6, entry_pos, dr, 1e4, YARN)
        icache[emit_dummy] = encode_rows(ikey, xf, dense_dtype=bf)

    def fused() -> None:
        ccache, icache = caches[1]
        st = state if ratio == 2 else None
        rd, wr = (read, write) if ratio == 2 else (None, None)
        lat = kc.compress_entries(comp, st, rd, wr, w, 1e-6, bf, entry_pos, emit, ccache, cf,
                                  dr, 1e4, YARN)  # fmt: skip
        kc.store_index_keys(lat, wk, kn, 1e-6, entry_pos, emit, icache, xf, dr, 1e4, YARN)

    previous()
    fused()
    live = emit[emit > 0]
    same = min(
        (caches[0][k][live] == caches[1][k][live]).all(1).float().mean().item() for k in (0, 1)
    )
    values = min(
        (decode_rows(caches[0][k][live], f, n) == decode_rows(caches[1][k][live], f, n))
        .all(1)
        .float()
        .mean()
        .item()
        for k, f, n in ((0, cf, d), (1, xf, di))
    )
    shape = f"ratio {ratio} T={t} D={d}->{di} rope={dr}"
    nbytes = comp.numel() * comp.element_size() + (t // ratio) * (
        row_width(cf, d) + row_width(xf, di)
    )
    prev_ms, new_ms = _ms(previous), _ms(fused)
    _row("compressor", "previous chain", shape, "qat", prev_ms, nbytes=nbytes)
    _row("compressor", "fused writers (shipped)", shape, "qat", new_ms, nbytes=nbytes,
         previous_over_this=prev_ms / new_ms, codes_equal=same, values_equal=values)  # fmt: skip


SECTIONS = {
    "ceilings": lambda a: bench_ceilings(),
    "mqa": lambda a: bench_mqa(a.sweep),
    "topk": lambda a: bench_topk(),
    "attn": lambda a: bench_attention(a.sweep),
    "rows": lambda a: bench_rows(),
    "rope": lambda a: bench_rope(),
    "workspace": lambda a: bench_workspace(),
    "writers": lambda a: bench_writers(),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    parser.add_argument("--sweep", action="store_true", help="time several kernel configs")
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU (run with TRITON_INTERPRET=1)"
    )
    args = parser.parse_args(argv)
    global DEV, SMALL, SWEEP
    SWEEP = args.sweep
    if args.smoke:
        DEV, SMALL = "cpu", True
    elif not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU (or --smoke)")
        return 2
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke)"
    print(f"GPU: {gpu}  torch {torch.__version__}  shapes as printed; dtypes per row", flush=True)
    failures = {}
    for name in args.only.split(","):
        try:
            SECTIONS[name](args)
        except Exception:  # keep the other sections' numbers
            failures[name] = traceback.format_exc()
            print(f"section {name} failed:\n{failures[name]}", flush=True)
        torch.cuda.empty_cache()
    if args.out is not None:
        benchutil.write_json(args.out, {"ceilings": CEIL, "rows": ROWS, "failures": failures})
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
