"""The indexer sections of the kernel benchmark (benchmarks/kernels.py): mqa (indexer logits,
and the row-chunked logits → top-k of `mqa_topk`) and topk."""

from __future__ import annotations

import torch

from benchmarks import kernels_common as common
from benchmarks.kernels_common import _maxdiff, _ms, _ms_eager, _pick, _row
from dsv4cp import ops, routing
from dsv4cp.kernels.indexer_logits import launch_mqa_logits as mqa_kernel
from dsv4cp.kernels.topk import launch_topk as topk_kernel

MQA_SWEEP = [(64, 128, 4, 2), (64, 128, 4, 3), (64, 256, 8, 3)]


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


def bench_mqa(sweep: bool) -> None:
    t, h, d, n = _pick((2048, 32, 128, 16384), (40, 4, 64, 300))
    q = torch.randn(t, h, d, device=common.DEV).bfloat16()
    w = torch.randn(t, h, device=common.DEV) / 64
    k = torch.randn(n, d, device=common.DEV).bfloat16()
    full = torch.full((t,), n, device=common.DEV)
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
    causal = torch.arange(t, device=common.DEV) + (n - t) + 1
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
    ks = torch.zeros(t, dtype=torch.long, device=common.DEV)
    ks[t // 2 + 7 :] = 3  # two requests: one mixed row block goes through the per-row kernel
    nv = torch.full((t,), n - 3, device=common.DEV)
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
    k_long = torch.randn(n_long, d, device=common.DEV).bfloat16()
    nv_long = torch.arange(t, device=common.DEV) + (n_long - t) + 1
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
    logits = torch.randn(t, w, device=common.DEV).bfloat16().float()
    nv = torch.full((t,), w, device=common.DEV)
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
