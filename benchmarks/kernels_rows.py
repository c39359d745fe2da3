"""The row-kernel sections of the kernel benchmark (benchmarks/kernels.py): rows (fused SWA
store and the ratio-1/2 compressor), rope (the RoPE-only passes) and writers (the layer's cache
writers, previous chain against the fused writers)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from benchmarks import kernels_common as common
from benchmarks.kernels_common import _maxdiff, _ms, _ms_eager, _pick, _row
from dsv4cp import ops, routing
from dsv4cp.kernels.compressor import compress_entries, index_key
from dsv4cp.kernels.norm_rope import norm_rope_rows
from dsv4cp.kernels.swa import store_swa_k
from dsv4cp.ops.rope import YarnScaling

YARN = YarnScaling(16.0, 65536, 32.0, 1.0)
ROWS_SWEEP = [(4, 4), (8, 4), (16, 4), (16, 8), (32, 8)]
# narrow rows (RoPE tails, index queries): (rows per 512 columns, warps)
ROPE_SWEEP = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (8, 4)]
ROPE_PREVIOUS = (8, 4)  # the default for every width before 2026-12-03 (fourth session)


def bench_rows() -> None:
    d, dr = _pick((512, 64), (96, 32))
    wgt = torch.rand(d, device=common.DEV) + 0.5
    for t in _pick((8192, 131072), (9,)):
        _swa_case(t, d, dr, wgt)
    for n in _pick((4096, 65536), (7,)):
        _compress_case(n, d, dr, wgt)


def _swa_case(t: int, d: int, dr: int, wgt: torch.Tensor) -> None:
    x = torch.randn(t, d, device=common.DEV).bfloat16()
    pos = torch.randint(0, 1 << 17, (t,), device=common.DEV)
    slots = torch.randperm(2 * t, device=common.DEV)[:t]
    cache = torch.zeros(2 * t, d, device=common.DEV, dtype=torch.bfloat16)
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
    for cfg in ROWS_SWEEP if common.SWEEP and t > _pick(8192, 1) else []:

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
    pos = torch.arange(t, device=common.DEV) + _pick(100000, 5)
    q = torch.randn(t, h, d, device=common.DEV).bfloat16()
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
    qp = torch.randn(t, hi * di, device=common.DEV).bfloat16()
    out = torch.empty(t * hi, di, device=common.DEV, dtype=torch.bfloat16)
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


def _rope_configs(
    op: str, shape: str, nbytes: float, run: Callable[[tuple[int, int] | None], None], **extra: Any
) -> None:
    prev = _ms(lambda: run(ROPE_PREVIOUS))
    _row(op, f"triton previous {ROPE_PREVIOUS}", shape, "bf16", prev, nbytes=nbytes)
    now = _ms(lambda: run(None))
    _row(op, "triton default", shape, "bf16", now, nbytes=nbytes, previous_over_this=prev / now,
         **extra)  # fmt: skip
    for cfg in ROPE_SWEEP if common.SWEEP else []:
        ms = _ms(lambda cfg=cfg: run(cfg))
        _row(op, f"triton rows/warps {cfg}", shape, "bf16", ms, nbytes=nbytes,
             previous_over_this=prev / ms)  # fmt: skip


def _compress_case(n: int, d: int, dr: int, wgt: torch.Tensor) -> None:
    comp = torch.randn(n, 2 * d, device=common.DEV)
    state = (torch.randn(n, d, device=common.DEV), torch.randn(n, d, device=common.DEV))
    pos = torch.arange(n, device=common.DEV) * 2
    rows = torch.arange(n, device=common.DEV)
    read = torch.where(rows == 0, 1, -1)
    write = torch.where(rows % 2 == 0, rows, -1)
    slots = torch.randperm(2 * n, device=common.DEV)[:n]
    cache = torch.zeros(2 * n, d, device=common.DEV, dtype=torch.bfloat16)
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
    wk = (torch.randn(128, d, device=common.DEV) / 20).bfloat16()
    kn = torch.rand(128, device=common.DEV) + 0.5
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
    x = torch.randn(t, d, device=common.DEV).bfloat16()
    pos = torch.arange(t, device=common.DEV) + 4096
    w = (torch.rand(d, device=common.DEV) + 0.5).bfloat16()
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
    rows = torch.arange(t, device=common.DEV)
    pos = rows + 4096  # one request's chunk at 4096: row 0 is its first token (even)
    w = (torch.rand(d, device=common.DEV) + 0.5).bfloat16()
    wk = (torch.randn(di, d, device=common.DEV) / 20).bfloat16()
    kn = (torch.rand(di, device=common.DEV) + 0.5).bfloat16()
    n_ent = t // ratio + 8
    emits = (pos + 1) % ratio == 0
    emit = torch.where(emits, (pos + 1) // ratio - 1 - 4096 // ratio + 1, -1)  # row 0: dummy
    emit_dummy = emit.clamp(min=0)
    entry_pos = ((pos + 1) // ratio - 1).clamp(min=0) * ratio
    if ratio == 2:
        comp = torch.randn(t, 2 * d, device=common.DEV)
        state = (torch.randn(t + 1, d, device=common.DEV), torch.randn(t + 1, d, device=common.DEV))
        read = torch.where(rows == 0, t, -1)
        write = torch.where(pos % 2 == 0, rows + 1, -1)  # state row 0: the dummy
        first = (rows == 0)[:, None]
    else:
        comp = torch.randn(t, d, device=common.DEV).bfloat16()
    caches = [
        (torch.zeros(n_ent, row_width(cf, d), device=common.DEV, dtype=torch.uint8),
         torch.zeros(n_ent, row_width(xf, di), device=common.DEV, dtype=torch.uint8))
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
