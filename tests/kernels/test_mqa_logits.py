"""GPU: the MQA-logits kernel against ops.indexer.mqa_logits (fp32 products of the same inputs).

Tolerance: ‖kernel − ops‖ / ‖ops‖ < 2e-5 over the finite entries and an identical -inf pattern.
bf16 products are exact in fp32 on the tensor cores; only the fp32 summation order differs.
"""

from __future__ import annotations

import pytest
import torch
from benchmarks.kernels_indexer import mqa_topk

from dsv4cp import ops, routing
from dsv4cp.kernels.indexer_logits import mqa_logits
from dsv4cp.ops.attention_quant import fake_quant_index_fp4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), fin), "the -inf pattern differs"
    if not fin.any():
        return 0.0
    d = (out[fin].double() - ref[fin].double()).norm()
    return (d / ref[fin].double().norm().clamp_min(1e-30)).item()


def _inputs(t, h, d, n, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(t, h, d, device="cuda", generator=g).to(dtype)
    w = torch.randn(t, h, device="cuda", generator=g) / 64
    k = torch.randn(n, d, device="cuda", generator=g).to(dtype)
    return q, w, k


@pytest.mark.parametrize(
    ("t", "h", "d", "n"),
    [
        (256, 32, 128, 4096),
        (1, 32, 128, 1000),
        (77, 32, 128, 333),
        (50, 4, 64, 129),
        (19, 3, 32, 70),
    ],
)
def test_matches_ops(t: int, h: int, d: int, n: int) -> None:
    q, w, k = _inputs(t, h, d, n)
    nv = torch.randint(0, n + 1, (t,), device="cuda")
    nv[0] = n
    if t > 2:
        nv[1] = 0
    out = mqa_logits(q, w, k, nv)
    assert out.shape == (t, n) and out.dtype == torch.float32
    assert _rel(out, ops.mqa_logits(q, w, k, nv)) < 2e-5


def test_causal_visible_and_width() -> None:
    t, h, d, n = 300, 32, 128, 2048
    q, w, k = _inputs(t, h, d, n, seed=1)
    nv = torch.arange(t, device="cuda") * 5 + 1  # like ⌊(p+1)/r⌋ growing with the row
    out = mqa_logits(q, w, k, nv, width=1600)
    assert _rel(out, ops.mqa_logits(q, w, k, nv, width=1600)) < 2e-5


def test_k_start_uniform_and_mixed() -> None:
    t, h, d, n = 150, 32, 128, 3000
    q, w, k = _inputs(t, h, d, n, seed=2)
    ks = torch.full((t,), 500, device="cuda")
    ks[70:] = 1700  # two requests; the boundary falls inside a 64-row block
    nv = torch.minimum(torch.randint(0, 1300, (t,), device="cuda"), n - ks)
    out = mqa_logits(q, w, k, nv, k_start=ks, width=1300)
    assert _rel(out, ops.mqa_logits(q, w, k, nv, k_start=ks, width=1300)) < 2e-5


def test_fp32_inputs() -> None:
    q, w, k = _inputs(40, 8, 64, 300, dtype=torch.float32, seed=3)
    nv = torch.randint(0, 301, (40,), device="cuda")
    assert _rel(mqa_logits(q, w, k, nv), ops.mqa_logits(q, w, k, nv)) < 2e-5


def test_no_visible_rows() -> None:
    q, w, k = _inputs(65, 32, 128, 512, seed=4)
    out = mqa_logits(q, w, k, torch.zeros(65, dtype=torch.long, device="cuda"))
    assert torch.all(out == float("-inf"))


def test_row_chunked_topk_matches_unchunked() -> None:
    t, h, d, n = 200, 32, 128, 4096
    q, w, k = _inputs(t, h, d, n, seed=5)
    nv = torch.randint(0, n + 1, (t,), device="cuda")
    whole = mqa_topk(q, w, k, nv, 512, max_logits_bytes=1 << 30)
    chunked = mqa_topk(q, w, k, nv, 512, max_logits_bytes=37 * n * 4)
    assert torch.equal(whole, chunked)
    assert torch.equal(whole, ops.topk_indices(mqa_logits(q, w, k, nv), nv, 512))


def test_unsupported_head_dim_raises() -> None:
    q, w, k = _inputs(4, 4, 96, 10)
    with pytest.raises(ValueError, match="power of two"):
        routing.mqa_logits(q, w, k, torch.full((4,), 10, device="cuda"))


@pytest.mark.parametrize("k_start", [False, True])
def test_qat_matches_ops(k_start: bool) -> None:
    """quant="qat": fake-fp4 q and k (bf16-exact), so every product and (at these scales) every
    dot is exact in fp32; the bf16 roundings and the in-order head sum are the twin's. Equal up
    to one bf16 ulp where a dot would not fit fp32, which these inputs avoid: expect identity."""
    t, h, d, n = 150, 32, 128, 3000
    q, w, k = _inputs(t, h, d, n, seed=6)
    q, k = fake_quant_index_fp4(q), fake_quant_index_fp4(k)
    ks = torch.full((t,), 500, device="cuda")
    if k_start:
        ks[70:] = 1700  # mixed blocks go to the per-row kernel
    nv = torch.minimum(torch.randint(0, 1300, (t,), device="cuda"), n - ks)
    out = mqa_logits(q, w, k, nv, k_start=ks, width=1300, quant="qat")
    want = ops.mqa_logits(q, w, k, nv, k_start=ks, width=1300, quant="qat")
    assert torch.equal(out, want)


def test_qat_packed_equals_unpacked_on_random_inputs() -> None:
    """The logits route's kernel in qat with its bf16 steps two values per instruction (packed,
    the default) and one at a time: the same bits, on inputs whose dots are not exact (random
    bf16, not fake-fp4), with -inf past each row's visible count."""
    from dsv4cp.kernels.indexer_logits import launch_mqa_logits

    t, h, d, n = 300, 32, 128, 2500
    q, w, k = _inputs(t, h, d, n, seed=7)
    nv = torch.randint(0, n + 1, (t,), device="cuda")
    packed = launch_mqa_logits(q, w, k, nv, quant="qat")
    unpacked = launch_mqa_logits(q, w, k, nv, quant="qat", packed=False)
    assert torch.equal(packed, unpacked)
    assert torch.isfinite(packed).any() and torch.isinf(packed).any()


@pytest.mark.parametrize(
    ("k_start", "convert", "relu_fma"),
    [(False, "magic", False), (True, "magic", False), (False, "cvt", True), (True, "cvt", True),
     (False, "magic", True), (False, "cvt", False)],
)  # fmt: skip
def test_qat_int8_equals_bf16_kernel(k_start: bool, convert: str, relu_fma: bool) -> None:
    """The int8-MMA qat kernel (`indexer_logits_int8`) forms the bf16 qat kernel's logits bit
    for bit on fake-fp4 inputs at Flash's index dims, the twin's too, with either conversion
    and either form of the relu and weight product (the weights of both signs); a key and a
    query row the encoding cannot hold exactly (a block 2^9 below the vector's largest, a head
    2^-40 small) take the per-tile bf16 branch and still agree."""
    from dsv4cp.kernels.indexer_logits import launch_mqa_logits
    from dsv4cp.kernels.indexer_logits_int8 import encode_int8, launch_mqa_logits_int8

    t, h, d, n = 700, 32, 128, 5000
    q, w, k = _inputs(t, h, d, n, seed=8)
    q, k = fake_quant_index_fp4(q).bfloat16(), fake_quant_index_fp4(k).bfloat16()
    k[9, 32:64] *= 2.0**-9
    q[300, 4] *= 2.0**-40
    assert encode_int8(k)[2][9] == 0 and encode_int8(q, w)[2][300] == 0
    assert encode_int8(k)[2].sum() == n - 1
    ks = torch.full((t,), 700, device="cuda")
    if k_start:
        ks[350:] = 1500  # mixed blocks go to the bf16 per-row kernel
    nv = torch.minimum(torch.randint(0, 3000, (t,), device="cuda"), n - ks)
    want = launch_mqa_logits(q, w, k, nv, k_start=ks, width=3000, quant="qat")
    assert (w < 0).sum() > t * h // 4 and (w > 0).sum() > t * h // 4
    kw = dict(k_start=ks, width=3000, convert=convert, relu_fma=relu_fma)
    got = launch_mqa_logits_int8(q, w, k, nv, **kw)
    assert torch.equal(got, want)
    assert torch.equal(got, ops.mqa_logits(q, w, k, nv, k_start=ks, width=3000, quant="qat"))
    assert torch.isfinite(got).sum() > t * 500
