"""GPU: kernels/fp8_linear against its ops twins on the H200.

act_quant_fp8: bit-exact (golden inputs, every finite bf16 value included, and Flash-sized rows).
fp8_linear: both add the scaled block partials in K order in fp32 with the same power-of-two
scales; they differ only in each block partial: the twin's is the exact dot rounded to fp32, the
kernel's is a bf16 tensor-core product (the fp8 values are exact in bf16, the products exact)
summed in fp32 over the block's 32 terms. Tensor cores may truncate rather than round (unit
u = 2^-23), so each partial is within 32·u·Σ|a·b| of the twin's, and the K/32 additions that follow
may each round the two slightly different sums differently: |Δ| ≤ (32 + K/16)·u·Σ|a·b| (the
absolute products of the dequantized operands); the bf16 outputs differ by that plus one bf16 ulp.
(The earlier fp8 tensor-core step needed 2^-13·Σ|a·b|: 2–3× looser at K 5120–8192.)
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from dsv4cp.kernels.fp8_linear import (
    act_quant_fp8,
    dequant_mm,
    fake_act_quant_fp8,
    fp8_linear,
    launch_fp8_linear,
)
from dsv4cp.ops import linear as ops_linear
from dsv4cp.ops import quant as ops_quant
from tests.kernels.test_fp8_linear_interpreter import GOLDEN

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_act_quant_bit_exact_on_golden_and_flash_rows() -> None:
    golden = load_file(GOLDEN, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    big = torch.randn(4096, 5120, device="cuda", generator=g)
    big = (
        big * torch.exp2(torch.randint(-30, 30, (4096, 1), device="cuda", generator=g))
    ).bfloat16()
    for x in (golden["adversarial.x"], golden["allbf16.x"], golden["random.x"], big):
        codes, scale = act_quant_fp8(x)
        want_codes, want_scale = ops_quant.act_quant_fp8(x)
        assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
        assert torch.equal(scale, want_scale)
        fake, want = fake_act_quant_fp8(x), ops_quant.fake_act_quant_fp8(x)
        assert fake.dtype == want.dtype
        assert torch.equal(fake.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize(("m", "n", "k"), [(512, 1280, 5120), (77, 512, 5120), (256, 5120, 8192)])
def test_fp8_linear_against_the_exact_twin(m: int, n: int, k: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(m + n)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 64).to(torch.float8_e4m3fn)
    shape = ops_linear.fp8_scale_shape(n, k)
    scale = torch.randint(118, 124, shape, device="cuda", dtype=torch.uint8, generator=g)
    scale = scale.view(torch.float8_e8m0fnu)
    got = fp8_linear(x, w, scale, out_dtype=torch.float32)
    want = ops_linear.fp8_linear(x, w, scale, out_dtype=torch.float32)
    a = ops_quant.fake_act_quant_fp8(x.float())
    b = ops_linear.dequant_fp8_blocks(w, scale)
    err = (got - want).abs()
    bound = (32 + k / 16) * 2.0**-23 * (a.abs() @ b.abs().t())
    print(
        f"fp8_linear {m}x{n}x{k}: max |Δ|/bound = {float((err / bound).max()):.3g}, "
        f"{float((err > 0).float().mean()):.3%} of fp32 outputs differ"
    )
    assert bool((err <= bound).all())
    want16 = ops_linear.fp8_linear(x, w, scale)
    # Each bf16 output is its fp32 value rounded once (≤ half an ulp each), and the fp32 values
    # differ by at most `bound`: under cancellation `bound` can exceed one bf16 ulp of the value.
    # cuBLAS (the large-GEMM path, `dequant_mm`) sums in its own order: bound K·2⁻²⁴·Σ|ab|.
    any_order = k * 2.0**-24 * (a.abs() @ b.abs().t())
    for got16, limit in (
        (launch_fp8_linear(x, w, scale), bound),
        (dequant_mm(x, w, scale), any_order),
    ):
        big = torch.maximum(got16.float().abs(), want16.float().abs())
        ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(big)))
        assert bool(((got16.float() - want16.float()).abs() <= limit + ulp).all())


def test_rows_valid_zeroes_rows_inside_the_quantization() -> None:
    """wo_b's padding rows: zeroed by the activation quantization of the cuBLAS path (no pass of
    its own) exactly as the twin's masked_fill zeroes them; valid rows unchanged bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(5)
    m, n, k = 4096, 5120, 8192
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    x[7] = float("inf")
    valid = torch.rand(m, device="cuda", generator=g) > 0.1
    valid[7] = False
    w = (torch.randn(n, k, device="cuda", generator=g) * 64).to(torch.float8_e4m3fn)
    shape = ops_linear.fp8_scale_shape(n, k)
    scale = torch.randint(118, 124, shape, device="cuda", dtype=torch.uint8, generator=g)
    scale = scale.view(torch.float8_e8m0fnu)
    got = fp8_linear(x, w, scale, rows_valid=valid)
    assert bool((got[~valid] == 0).all())
    assert torch.equal(got, dequant_mm(x.masked_fill(~valid[:, None], 0), w, scale))


def test_kept_dense_weight_is_what_the_cublas_route_reads() -> None:
    """`Linear.keep_dequantized`: the cuBLAS route multiplies by the kept bf16 copy (a different
    copy gives that weight's product) and the output keeps its bits (the copy is the same exact
    bf16 weight the route dequantized per call)."""
    from dsv4cp.layers.linear import Linear

    g = torch.Generator(device="cuda").manual_seed(11)
    m, n, k = 1024, 1280, 5120
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    weights = []
    for _ in range(2):
        w = (torch.randn(n, k, device="cuda", generator=g) * 64).to(torch.float8_e4m3fn)
        shape = ops_linear.fp8_scale_shape(n, k)
        s = torch.randint(118, 124, shape, device="cuda", dtype=torch.uint8, generator=g)
        weights.append((w, s.view(torch.float8_e8m0fnu)))
    lin = Linear(k, n, storage="fp8", dtype=torch.bfloat16, device="cuda")
    lin.weight.copy_(weights[0][0])
    assert lin.scale is not None
    lin.scale.copy_(weights[0][1])
    before = lin(x)
    assert lin.keep_dequantized() == n * k * 2
    assert torch.equal(lin(x), before)
    other = ops_linear.dequant_fp8_blocks(*weights[1], out_dtype=torch.bfloat16)
    got = fp8_linear(x, *weights[0], dense=other)
    assert torch.equal(got, dequant_mm(x, *weights[1]))
    assert not torch.equal(got, before)
