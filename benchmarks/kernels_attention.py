"""The attention sections of the kernel benchmark (benchmarks/kernels.py): attn (sparse
attention with sink, FlashMLA's sparse prefill as the peer) and workspace (FlashMLA's bf16
workspace over the caches)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from benchmarks import kernels_common as common
from benchmarks.kernels_common import _maxdiff, _ms, _pick, _row
from dsv4cp import ops
from dsv4cp.kernels.attention import attention_flops
from dsv4cp.kernels.attention import launch_sparse_attention as attn_kernel
from dsv4cp.kernels.attention_gluon import (
    PIPELINED_CONFIGS,
    gluon_attention_available,
    sparse_attention_gluon,
)
from dsv4cp.kernels.attention_gluon_halves import sparse_attention_gluon_halves
from dsv4cp.kernels.attention_gluon_ws import WS_CONFIG, WS_CONFIGS, sparse_attention_gluon_ws

ATTN_SWEEP = [(64, 8, 2), (64, 8, 3), (32, 8, 2)]
Kernel = Callable[[Tensor, Tensor, Tensor, Tensor, float], Tensor]


def flashmla_sparse() -> Kernel | None:
    """FlashMLA's sparse prefill (legacy, the Hopper path) with the twin's signature
    (q [T, H, D], kv [N, D], indices [T, K], sink, scale), or None — said — where `flash_mla`
    does not import."""
    try:
        import flash_mla
    except Exception as exc:  # the peer is optional
        print(f"flash_mla unavailable: {exc!r}")
        return None

    def run(q: Tensor, kv: Tensor, idx: Tensor, sink: Tensor, scale: float) -> Tensor:
        return flash_mla.flash_mla_sparse_fwd(
            q, kv[:, None], idx[:, None], scale, q.shape[-1], attn_sink=sink, use_legacy=True
        )[0]

    return run


def _key(name: str) -> str:
    """A JSON key for a kernel's ratio to FlashMLA: "gluon sm_90 (128, 1)" → gluon_sm_90_128x1."""
    for a, b in ((" (", "_"), (", ", "x"), (")", ""), (" ", "_"), ("-", "_"), ("/", "_")):
        name = name.replace(a, b)
    return f"{name}_over_flashmla"


def bench_attention(
    sweep: bool, gluon_ws: bool = False, halves_regs: list[tuple[int, int]] | None = None
) -> None:
    """On Hopper: the pipelined Gluon configurations, the routed half-buffer kernel and the
    warp-specialised one; `gluon_ws` adds the other warp-specialised configuration
    (docs/performance.md §26); `halves_regs` adds the half-buffer kernel at other
    (second math warpgroup, loader) register grants (§28)."""
    t, h, d, n, kk = _pick((4096, 64, 512, 20480, 640), (4, 16, 64, 100, 80))
    q = torch.randn(t, h, d, device=common.DEV).bfloat16()
    kv = torch.randn(n, d, device=common.DEV).bfloat16()
    idx = torch.randint(0, n, (t, kk), device=common.DEV, dtype=torch.int32)
    sink = torch.randn(h, device=common.DEV)
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
    ms_triton = float("nan")
    for cfg in ATTN_SWEEP if sweep else [None]:
        out = attn_kernel(q, kv, idx, sink, scale, config=cfg)
        ms = _ms(lambda cfg=cfg: attn_kernel(q, kv, idx, sink, scale, config=cfg))
        if cfg in (None, ATTN_SWEEP[0]):
            ms_triton = ms
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
    p = torch.arange(t, device=common.DEV) * 4
    mask = torch.arange(top, device=common.DEV)[None, :] <= p[:, None]
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
    gluon_ms: dict[str, float] = {}
    if gluon_attention_available(q):
        gluon = {
            f"gluon sm_90 {cfg}": functools.partial(sparse_attention_gluon, config=cfg)
            for cfg in PIPELINED_CONFIGS
        }
        # the ws kernel's default configuration, then (--gluon-ws) the other
        ws_configs = [WS_CONFIG]
        if gluon_ws:
            ws_configs += [cfg for cfg in WS_CONFIGS if cfg != WS_CONFIG]
        gluon["gluon halves sm_90 (64, 2)"] = sparse_attention_gluon_halves
        for math_regs, load_regs in halves_regs or []:
            gluon[f"gluon halves sm_90 (64, 2) regs {math_regs}/{load_regs}"] = functools.partial(
                sparse_attention_gluon_halves, math_regs=math_regs, load_regs=load_regs
            )
        for cfg in ws_configs:
            gluon[f"gluon ws sm_90 {cfg}"] = functools.partial(
                sparse_attention_gluon_ws, config=cfg
            )
        ref_v41 = ops.sparse_attention(q, kv, idx_v41, sink, scale)
        for name, fn in gluon.items():
            for label, ix, want in (("", idx, ref), (", V4.1 -1 rows", idx_v41, ref_v41)):
                out = fn(q, kv, ix, sink, scale)
                gluon_ms[name + label] = _ms(lambda fn=fn, ix=ix: fn(q, kv, ix, sink, scale))
                _row(
                    "attn",
                    name + label,
                    shape,
                    "bf16",
                    gluon_ms[name + label],
                    flops=flops if not label else 2.0 * h * valid * 2 * d,
                    maxdiff=_maxdiff(out, want),
                )
    else:
        print("gluon sm_90 kernels: not run (need Gluon, a Hopper GPU and 64 heads x 512)")
    flashmla = flashmla_sparse()
    if flashmla is None:
        return

    def peer() -> torch.Tensor:
        return flashmla(q, kv, idx, sink, scale)

    out = peer()
    peer_ms = _ms(peer)
    _row(
        "attn",
        "FlashMLA sparse_fwd (legacy)",
        shape,
        "bf16",
        peer_ms,
        flops=flops,
        maxdiff=_maxdiff(out, ref),
        triton_over_flashmla=peer_ms / ms_triton,
        **{_key(k): peer_ms / v for k, v in gluon_ms.items() if "-1 rows" not in k},  # fmt: skip
    )
    peer_v41_ms = _ms(lambda: flashmla(q, kv, idx_v41, sink, scale))
    _row(
        "attn",
        "FlashMLA, V4.1 -1 rows",
        shape,
        "bf16",
        peer_v41_ms,
        flops=2.0 * h * valid * 2 * d,
        flops_counted="valid indices",
        triton_over_flashmla=peer_v41_ms / ms,
        **{
            _key(k.removesuffix(", V4.1 -1 rows")): peer_v41_ms / v
            for k, v in gluon_ms.items()
            if "-1 rows" in k
        },  # fmt: skip
    )


def bench_workspace() -> None:
    """`attention_workspace.build_workspace` for one index layer's chunk at Flash shapes: 16K
    queries, the SWA window (128 per row) over the chunk's SWA rows and the top-k (512 per row)
    over a ratio-2 cache of 8K entries, qat formats; the rows' numbering by the Triton kernels
    (shipped) and by their torch twins (`ops.workspace_rows`: marks by `scatter_reduce`, not the
    `index_fill_` into a sink row that the CUDA path ran before the kernels), same decode, same
    outputs."""
    from dsv4cp.kernels import attention_workspace
    from dsv4cp.ops import workspace_rows as ops_rows
    from dsv4cp.ops.kv_format import encode_rows

    t, n_swa, n_comp, d = _pick((16384, 16384, 8192, 512), (8, 24, 16, 64))
    win, top = _pick((128, 512), (8, 16))
    gen = torch.Generator(device=common.DEV).manual_seed(0)
    swa = encode_rows(
        torch.randn(n_swa, d, device=common.DEV), "fp8_ue8m0_32", dense_dtype=torch.bfloat16
    )
    comp = encode_rows(
        torch.randn(n_comp, d, device=common.DEV), "fp8_ue8m0_32", dense_dtype=torch.bfloat16
    )
    rows = torch.arange(t, device=common.DEV)[:, None]
    swa_idx = (rows - torch.arange(win, device=common.DEV)[None, :]).clamp(min=-1).int()
    comp_idx = torch.randint(0, n_comp, (t, top), device=common.DEV, generator=gen).int()
    comp_idx = torch.where(comp_idx > rows // 2, -1, comp_idx)
    src = attention_workspace.workspace_sources(swa, swa_idx, comp, comp_idx, "fp8_ue8m0_32",
                                                "fp8_ue8m0_32", (n_swa, n_comp))  # fmt: skip

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        return attention_workspace.build_workspace(src, slice(0, t), d, torch.bfloat16)

    shape = f"T={t} K={win}+{top} N={n_swa}+{n_comp} D={d}"
    kv, idx = run()
    ms_kernel = _ms(run)
    saved = attention_workspace.k_rows
    attention_workspace.k_rows = ops_rows  # type: ignore[assignment] # the same functions, in torch
    try:
        kv_t, idx_t = run()
        ms_twin = _ms(run)
    finally:
        attention_workspace.k_rows = saved
    same = bool(torch.equal(idx, idx_t)) and bool(
        torch.equal(kv[idx[idx >= 0].long()], kv_t[idx_t[idx_t >= 0].long()])
    )
    nbytes = 4.0 * (swa_idx.numel() + comp_idx.numel()) * 3  # indices read twice, written once
    _row("workspace", "ops twins (torch numbering)", shape, "int32", ms_twin, nbytes=nbytes)
    _row("workspace", "kernels (shipped)", shape, "int32", ms_kernel, nbytes=nbytes,
         twin_over_kernel=ms_twin / ms_kernel, same_output=same)  # fmt: skip
