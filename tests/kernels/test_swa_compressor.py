"""GPU: the fused norm/RoPE/store kernels against ops.swa and ops.compressor.

Tolerance: every element within one bf16 step of ops (|Δ| ≤ 2^-7·|ops| + 2^-8·max|row|, the
second term for RoPE outputs that cancel) and at least 97% of elements bitwise equal. The kernel's
fp32 math differs from torch's only by FMA contraction and reduction order, which can move a
value across a bf16 rounding boundary.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dsv4cp import ops
from dsv4cp.kernels import compressor as kc
from dsv4cp.kernels import swa as ks
from dsv4cp.kernels.norm import rms_norm
from dsv4cp.kernels.rope import rope_index_queries
from dsv4cp.kernels.swa import store_swa_k, swa_key
from dsv4cp.ops.kv_format import decode_rows, row_width
from dsv4cp.ops.rope import YarnScaling

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
YARN = YarnScaling(16.0, 65536, 32.0, 1.0)


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    o, r = out.float(), ref.float()
    row = r.abs().amax(-1, keepdim=True)
    assert torch.all((o - r).abs() <= 2**-7 * r.abs() + 2**-8 * row), (o - r).abs().max()
    assert (out == ref).float().mean().item() >= 0.97


@pytest.mark.parametrize(("t", "d", "dr"), [(1000, 512, 64), (1, 512, 64), (77, 96, 32)])
def test_swa(t: int, d: int, dr: int) -> None:
    x = torch.randn(t, d, device="cuda").bfloat16()
    pos = torch.randint(0, 1 << 20, (t,), device="cuda")
    w = torch.rand(d, device="cuda") + 0.5
    for yarn, theta in ((None, 10000.0), (YARN, 160000.0)):
        _close(
            swa_key(x, pos, w, 1e-20, dr, theta, yarn, torch.bfloat16),
            ops.swa_key(x, pos, w, 1e-20, dr, theta, yarn, torch.bfloat16),
        )
    slots = torch.randperm(3 * t, device="cuda")[:t]
    c1 = torch.full((3 * t, d), 3.0, device="cuda", dtype=torch.bfloat16)
    c2 = c1.clone()
    store_swa_k(x, pos, slots, c1, w, 1e-20, dr, 10000.0, None)
    ops.store_swa_k(x, pos, slots, c2, w, 1e-20, dr, 10000.0, None)
    _close(c1, c2)


@pytest.mark.parametrize(("n", "d", "dr"), [(513, 512, 64), (7, 96, 32)])
def test_compressor_ratio2(n: int, d: int, dr: int) -> None:
    kv, g, pkv, pg = (torch.randn(n, d, device="cuda") for _ in range(4))
    w = torch.rand(d, device="cuda") + 0.5
    pos = torch.arange(n, device="cuda") * 2
    assert torch.allclose(kc.pair_pool(kv, g, pkv, pg), ops.pair_pool(kv, g, pkv, pg), atol=1e-5)
    pooled = ops.pair_pool(kv, g, pkv, pg)
    lat = ops.compressed_latent(pooled, w, 1e-20, torch.bfloat16)
    _close(kc.compressed_latent(pooled, w, 1e-20, torch.bfloat16), lat)
    key = ops.compressed_key(lat, pos, dr, 160000.0, YARN)
    _close(kc.compressed_key(lat, pos, dr, 160000.0, YARN), key)
    # the layer's fused pass: partners from the row above, and from the state for rows 0 and 3
    comp = torch.cat([kv, g], 1)
    state = (torch.randn(n + 5, d, device="cuda"), torch.randn(n + 5, d, device="cuda"))
    state2 = (state[0].clone(), state[1].clone())
    read = torch.full((n,), -1, device="cuda")
    read[0], read[3 % n] = n + 4, 2
    write = torch.where(torch.arange(n, device="cuda") % 2 == 0, torch.arange(n, device="cuda"), -1)
    # row 3 reads state row 2, which row 2 writes: the write lands after every read
    emit = torch.randperm(2 * n, device="cuda")[:n]
    emit[1::3] = -1
    c1 = torch.zeros(2 * n, d, device="cuda", dtype=torch.bfloat16)
    c2 = c1.clone()
    args = (read, write, w, 1e-20, torch.bfloat16, pos, emit)
    latent = kc.compress_entries(comp, state, *args, c1, "dense", dr, 160000.0, YARN)
    want = ops.compress_entries(comp, state2, *args, c2, "dense", dr, 160000.0, YARN)
    _close(latent, want)
    _close(c1, c2)
    assert torch.equal(state[0], state2[0]) and torch.equal(state[1], state2[1])


def test_compressor_reads_the_gathered_rows_through_their_index() -> None:
    """The layer at CP > 1: comp_kv as the all-gather leaves it (rank-major, padding rows) read
    through `CPLayout.rerange_index` equals the token-order run, bit for bit (same math)."""
    from dsv4cp.cp.layout import CPLayout

    n, d, dr = 1000, 512, 64
    lay = CPLayout.build(n, 8).to("cuda")
    comp = torch.cat([torch.randn(n, d, device="cuda"), torch.randn(n, d, device="cuda")], 1)
    gathered = torch.full((lay.gathered_rows, 2 * d), float("nan"), device="cuda")
    gathered[lay.rerange_index] = comp  # the padding rows are NaN: never read
    w = torch.rand(d, device="cuda") + 0.5
    pos = torch.arange(n, device="cuda") + 77
    read = torch.full((n,), -1, device="cuda")
    read[0] = 3
    write = torch.where(pos % 2 == 0, torch.arange(n, device="cuda"), -1)  # distinct rows
    emit = torch.where(pos % 2 == 1, torch.arange(n, device="cuda") // 2, -1)
    out = []
    for x, src in ((comp, None), (gathered, lay.rerange_index)):
        g = torch.Generator(device="cuda").manual_seed(0)
        state = tuple(torch.randn(n, d, device="cuda", generator=g) for _ in range(2))
        cache = torch.zeros(n, d, device="cuda", dtype=torch.bfloat16)
        args = (read, write, w, 1e-20, torch.bfloat16, pos, emit, cache, "dense", dr, 1e4)
        out.append((kc.compress_entries(x, state, *args, YARN, src_rows=src), cache, state))
    (lat, cache, state), (lat2, cache2, state2) = out
    assert torch.equal(lat, lat2) and torch.equal(cache, cache2)
    assert torch.equal(state[0], state2[0]) and torch.equal(state[1], state2[1])


def test_compressor_ratio1_and_index_key() -> None:
    n, d, dr, di = 1025, 512, 64, 128
    kv = torch.randn(n, d, device="cuda").bfloat16()
    w = torch.rand(d, device="cuda") + 0.5
    pos = torch.arange(n, device="cuda") + 5000
    slots = torch.randperm(n + 10, device="cuda")[:n]
    cache = torch.zeros(n + 10, d, device="cuda", dtype=torch.bfloat16)
    args = (None, None, None, w, 1e-20, torch.bfloat16, pos, slots, cache, "dense")
    latent = kc.compress_entries(kv, *args, dr, 160000.0, YARN)
    want = ops.compressed_latent(kv, w, 1e-20, torch.bfloat16)
    _close(latent, want)
    _close(cache[slots], ops.compressed_key(latent, pos, dr, 160000.0, YARN))
    wk = (torch.randn(di, d, device="cuda") / 20).bfloat16()
    kn = torch.rand(di, device="cuda") + 0.5
    _close(
        kc.index_key(latent, wk, kn, 1e-20, pos, dr, 160000.0, YARN),
        ops.index_key(latent, wk, kn, 1e-20, pos, dr, 160000.0, YARN),
    )


# ---------------------------------------------------------------- quant="qat"
# The quantizers are bit-exact (interpreter tests); on the GPU the fp32 norm / RoPE math before
# them may round across a bf16 boundary (FMA contraction), which can move one code of a block by
# one step. So: >= 97% of the elements bitwise equal, and every element within one code step of
# its block (fp8 e4m3: 2^-3 of the block's amax; fp4 e2m1: two scale units, < 0.7 of the amax).
FP8_STEP, FP4_STEP = 2.0**-3, 0.7


def _quant_close(out: torch.Tensor, ref: torch.Tensor, block: int, step: float) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    o, r = out.float(), ref.float()
    amax = r.abs().unflatten(-1, (-1, block)).amax(-1, keepdim=True)
    bound = (step * amax).expand(*amax.shape[:-1], block).flatten(-2)
    assert torch.all((o - r).abs() <= bound), ((o - r).abs() / bound.clamp_min(1e-30)).max()
    assert (out == ref).float().mean().item() >= 0.97


@pytest.mark.parametrize(("t", "d", "dr"), [(1000, 512, 64), (77, 96, 32), (33, 64, 16)])
def test_swa_qat(t: int, d: int, dr: int) -> None:
    x = torch.randn(t, d, device="cuda").bfloat16()
    pos = torch.randint(0, 1 << 20, (t,), device="cuda")
    w = (torch.rand(d, device="cuda") + 0.5).bfloat16()
    for yarn, theta in ((None, 10000.0), (YARN, 160000.0)):
        got = swa_key(x, pos, w, 1e-20, dr, theta, yarn, quant="qat")
        want = ops.swa_key(x, pos, w, 1e-20, dr, theta, yarn, quant="qat")
        _quant_close(got, want, 32, FP8_STEP)
    slots = torch.randperm(3 * t, device="cuda")[:t]
    c1 = torch.zeros(3 * t, d, device="cuda", dtype=torch.bfloat16)
    c2 = c1.clone()
    store_swa_k(x, pos, slots, c1, w, 1e-20, dr, 10000.0, None, "qat")
    ops.store_swa_k(x, pos, slots, c2, w, 1e-20, dr, 10000.0, None, "qat")
    _quant_close(c1, c2, 32, FP8_STEP)


@pytest.mark.parametrize(("n", "d", "dr", "di"), [(513, 512, 64, 128), (7, 64, 16, 32)])
def test_compressed_and_index_key_qat(n: int, d: int, dr: int, di: int) -> None:
    lat = torch.randn(n, d, device="cuda").bfloat16()
    pos = torch.arange(n, device="cuda") * 4
    got = kc.compressed_key(lat, pos, dr, 160000.0, YARN, quant="qat")
    _quant_close(got, ops.compressed_key(lat, pos, dr, 160000.0, YARN, quant="qat"), 16, FP4_STEP)
    wk = (torch.randn(di, d, device="cuda") / 20).bfloat16()
    kn = (torch.rand(di, device="cuda") + 0.5).bfloat16()
    got = kc.index_key(lat, wk, kn, 1e-20, pos, dr, 160000.0, YARN, quant="qat")
    want = ops.index_key(lat, wk, kn, 1e-20, pos, dr, 160000.0, YARN, quant="qat")
    _quant_close(got, want, 32, FP4_STEP)


def test_index_queries_qat() -> None:
    t, h, di, dr = 300, 32, 128, 64
    qp = torch.randn(t, h * di, device="cuda").bfloat16()
    pos = torch.randint(0, 1 << 20, (t,), device="cuda")
    got = rope_index_queries(qp, pos, dr, 160000.0, YARN, head_dim=di, quant="qat")
    want = ops.rope_index_queries(qp, pos, dr, 160000.0, YARN, head_dim=di, quant="qat")
    _quant_close(got, want, 32, FP4_STEP)
    got = rope_index_queries(qp, pos, dr, 160000.0, YARN, head_dim=di)
    _close(got, ops.rope_index_queries(qp, pos, dr, 160000.0, YARN, head_dim=di))


@pytest.mark.parametrize(("t", "d"), [(16384, 1280), (4099, 5120), (3, 96)])
def test_rms_norm(t: int, d: int) -> None:
    x = (torch.randn(t, d, device="cuda") * 3).bfloat16()
    w = torch.rand(d, device="cuda") + 0.5
    _close(rms_norm(x, w, 1e-6), ops.rms_norm(x, w, 1e-6))
    _close(rms_norm(x, None, 1e-6), ops.rms_norm(x, None, 1e-6))
    assert torch.equal(rms_norm(x[5:9], w, 1e-6), rms_norm(x, w, 1e-6)[5:9])  # row-local


# ---------------------------------------------------------------- the caches' encoded rows
# Bit for bit: the codes the kernel stores decode to the fake-quant values the same kernel stores
# into a dense (`store_values`) cache; against the twins, as `_quant_close` above.


def _encoded_pair(write: Any, fmt: str, n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    enc = torch.zeros(n, row_width(fmt, d), device="cuda", dtype=torch.uint8)
    dense = torch.zeros(n, d, device="cuda", dtype=torch.bfloat16)
    write(enc)
    write(dense)
    return enc, dense


# 65,536 rows: with the row's sum of squares in Triton's layout order (before the pairwise sum),
# the two SWA-key variants normalized about one row in 8,000 an ulp apart on an H100.
@pytest.mark.parametrize(
    ("n", "d", "dr", "di"), [(65536, 512, 64, 128), (4099, 512, 64, 128), (37, 64, 16, 32)]
)
def test_encoded_rows_decode_to_the_fake_quant(n: int, d: int, dr: int, di: int) -> None:
    x = (torch.randn(n, d, device="cuda") * 3).bfloat16()
    pos = torch.randint(0, 1 << 20, (n,), device="cuda")
    w = (torch.rand(d, device="cuda") + 0.5).bfloat16()
    fmt = "fp8_ue8m0_32"
    enc = ks.swa_key_rows(x, pos, w, 1e-20, dr, 1e4, YARN, "qat", fmt, torch.uint8)
    dense = ks.swa_key_rows(x, pos, w, 1e-20, dr, 1e4, YARN, "qat", fmt, torch.bfloat16)
    assert torch.equal(decode_rows(enc, fmt, d).bfloat16(), dense)
    want = ops.swa_key_rows(x, pos, w, 1e-20, dr, 1e4, YARN, "qat", fmt, torch.uint8)
    _quant_close(decode_rows(enc, fmt, d), decode_rows(want, fmt, d), 32, FP8_STEP)

    emit = torch.randperm(n + 7, device="cuda")[:n]
    emit[::5] = -1
    fmt = "fp4_e4m3_16"

    def entries(cache: torch.Tensor) -> None:
        args = (None, None, None, w, 1e-20, torch.bfloat16, pos, emit, cache, fmt)
        kc.compress_entries(x, *args, dr, 1e4, YARN)

    enc, dense = _encoded_pair(entries, fmt, n + 7, d)
    assert torch.equal(decode_rows(enc, fmt, d).bfloat16(), dense)
    twin = torch.zeros_like(enc)
    args = (None, None, None, w, 1e-20, torch.bfloat16, pos, emit, twin, fmt)
    ops.compress_entries(x, *args, dr, 1e4, YARN)
    _quant_close(decode_rows(enc, fmt, d), decode_rows(twin, fmt, d), 16, FP4_STEP)

    fmt = "fp4_ue8m0_32"
    wk = (torch.randn(di, d, device="cuda") / 20).bfloat16()
    kn = (torch.rand(di, device="cuda") + 0.5).bfloat16()

    def index(cache: torch.Tensor) -> None:
        kc.store_index_keys(x, wk, kn, 1e-20, pos, emit, cache, fmt, dr, 1e4, YARN)

    enc, dense = _encoded_pair(index, fmt, n + 7, di)
    assert torch.equal(decode_rows(enc, fmt, di).bfloat16(), dense)
    twin = torch.zeros_like(enc)
    ops.store_index_keys(x, wk, kn, 1e-20, pos, emit, twin, fmt, dr, 1e4, YARN)
    _quant_close(decode_rows(enc, fmt, di), decode_rows(twin, fmt, di), 32, FP4_STEP)
