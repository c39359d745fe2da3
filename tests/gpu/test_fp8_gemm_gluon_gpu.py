"""GPU (Hopper): kernels/fp8_gemm_gluon against its twin, the exact products summed in fp32.

`fp8_gemm_gluon(a, w, scale)` multiplies the same exact bf16 operands as `dequant_mm` (the
quantized activation, the weight's codes × block scales), so its fp32 output differs from the
twin's exact dot by the summation order only: |Δ| ≤ K·2⁻²⁴·Σ|a·b| (tensor cores may truncate:
the same K·u bound cuBLAS gets in test_fp8_linear), and a bf16 output by that plus one bf16 ulp.
The weight's dequantization is exact, so a weight whose products sum exactly (small integers)
gives the twin's bits.
"""

from __future__ import annotations

import pytest
import torch

from dsv4cp.kernels import fp8_gemm_gluon as gemm
from dsv4cp.kernels import fp8_linear
from dsv4cp.ops import linear as ops_linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs a Hopper GPU",
    ),
    pytest.mark.skipif(not gemm.HAVE_GLUON, reason="needs Triton's Gluon"),
]


def _operands(m: int, n: int, k: int, seed: int, e8m0: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 64).to(torch.float8_e4m3fn)
    shape = ops_linear.fp8_scale_shape(n, k)
    scale = torch.randint(118, 124, shape, device="cuda", dtype=torch.uint8, generator=g)
    if e8m0:
        return a, w, scale.view(torch.float8_e8m0fnu)
    return a, w, torch.exp2(scale.float() - 127)


def _bf16_ulp(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at the larger of |x| and |y|, elementwise (float64)."""
    big = torch.maximum(x.double().abs(), y.double().abs())
    return torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(big)))


# (2048, 5120, 8192): a 32 MiB activation, so programs run in groups of 16 weight tiles (40 = 16
# + 16 + 8); (300, 130, 224): 7 steps, the odd step after the loop
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(2048, 32768, 1280), (2048, 5120, 8192), (2048, 1792, 5120), (1999, 300, 96), (5, 256, 32),
     (300, 130, 224)],
)  # fmt: skip
def test_against_the_exact_products(m: int, n: int, k: int) -> None:
    a, w, scale = _operands(m, n, k, seed=m + n + k)
    b = ops_linear.dequant_fp8_blocks(w, scale)  # fp32, exact
    exact = a.double() @ b.double().t()
    got32 = gemm.fp8_gemm_gluon(a, w, scale, out_dtype=torch.float32)
    bound = k * 2.0**-24 * (a.float().abs() @ b.abs().t()).double()
    err = (got32.double() - exact).abs()
    print(f"{m}x{n}x{k}: max |Δ|/bound {float((err / bound).max()):.3g}")
    assert bool((err <= bound).all())
    got16 = gemm.fp8_gemm_gluon(a, w, scale)
    want16 = exact.bfloat16()
    ulp = _bf16_ulp(got16, want16)
    assert bool(((got16.double() - want16.double()).abs() <= bound + ulp).all())


@pytest.mark.parametrize("e8m0", [True, False])
def test_exact_sums_give_the_twins_bits(e8m0: bool) -> None:
    """Small-integer operands: every partial sum is exact in fp32, so any order gives the same
    bits as the cuBLAS route over the dequantized weight (fp32 scales take the other branch)."""
    m, n, k = 640, 1024, 2048
    g = torch.Generator(device="cuda").manual_seed(3)
    a = torch.randint(-4, 5, (m, k), device="cuda", generator=g).bfloat16()
    w = torch.randint(-4, 5, (n, k), device="cuda", generator=g).float().to(torch.float8_e4m3fn)
    shape = ops_linear.fp8_scale_shape(n, k)
    byte = torch.randint(125, 129, shape, device="cuda", dtype=torch.uint8, generator=g)
    scale = byte.view(torch.float8_e8m0fnu) if e8m0 else torch.exp2(byte.float() - 127)
    want = a.float() @ ops_linear.dequant_fp8_blocks(w, scale).t()
    got = gemm.fp8_gemm_gluon(a, w, scale, out_dtype=torch.float32)
    assert torch.equal(got, want)


def test_the_program_order_does_not_change_the_bits() -> None:
    """Each output tile's sum is the same whichever order the programs run in: one weight tile
    per group, the default grouping (16 at this 32 MiB activation), and 7 (a partial last group
    of 40 tiles)."""
    a, w, scale = _operands(2048, 5120, 8192, seed=9)
    assert gemm.group_width(2048, 5120, 8192) == 16
    want = gemm.fp8_gemm_gluon(a, w, scale, out_dtype=torch.float32)
    for group in (1, 7):
        got = gemm.fp8_gemm_gluon(a, w, scale, out_dtype=torch.float32, group=group)
        assert torch.equal(got, want), group


def test_bad_operands_are_refused() -> None:
    a, w, scale = _operands(64, 256, 64, seed=1)
    with pytest.raises(ValueError, match="multiple of 32"):
        gemm.fp8_gemm_gluon(a[:, :48], w[:, :48], scale[:, :2])
    with pytest.raises(ValueError, match="bf16"):
        gemm.fp8_gemm_gluon(a.float(), w, scale)
    with pytest.raises(ValueError, match="group must be"):
        gemm.fp8_gemm_gluon(a, w, scale, group=0)


def test_fp8_linear_routes_to_it_under_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """DSV4CP_FP8_GEMM=gluon: `fp8_linear` at 2,048 bf16 rows is `gluon_mm` (the activation's
    quantization, then this kernel), within the summation bound of the cuBLAS route; with a kept
    bf16 weight it stays on cuBLAS, bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(2, 1024, 1280, device="cuda", generator=g).bfloat16()
    w, scale = ops_linear.quantize_fp8_blocks(torch.randn(4096, 1280, device="cuda") * 0.02)
    monkeypatch.setenv(fp8_linear.FP8_GEMM_FLAG, "gluon")
    out = fp8_linear.fp8_linear(x, w, scale)
    assert out.shape == (2, 1024, 4096)
    got = out.reshape(-1, 4096)
    a = fp8_linear.quantized_act_bf16(x.reshape(-1, 1280))
    assert torch.equal(got, gemm.fp8_gemm_gluon(a, w, scale))
    b = ops_linear.dequant_fp8_blocks(w, scale)
    want = fp8_linear.dequant_mm(x, w, scale).reshape(-1, 4096)
    bound = 1280 * 2.0**-24 * (a.float().abs() @ b.abs().t()).double()
    ulp = _bf16_ulp(got, want)
    assert bool(((got.double() - want.double()).abs() <= bound + 2 * ulp).all())
    dense = fp8_linear.dequant_weight_bf16(w, scale)
    kept = fp8_linear.fp8_linear(x, w, scale, dense=dense)
    assert torch.equal(kept, fp8_linear.dequant_mm(x, w, scale, dense=dense))
