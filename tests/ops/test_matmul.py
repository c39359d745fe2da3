"""linear_fp32: x · wᵀ with an fp32 result (SGLang's linear_bf16_fp32)."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.ops import linear_fp32
from dsv4cp.ops.matmul import MM_OUT_DTYPE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_is_the_fp32_product_of_the_operands(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(9, 64).to(dtype), torch.randn(24, 64).to(dtype)
    out = linear_fp32(x, w)
    assert out.dtype == torch.float32 and out.shape == (9, 24)
    assert torch.equal(out, x.float() @ w.float().t())


def test_probe_is_a_constant_bool() -> None:
    assert isinstance(MM_OUT_DTYPE, bool)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_matches_the_fp32_product() -> None:
    # bf16 products are exact in fp32; fp32 accumulation over K = 4096 errs ~√K·2⁻²⁴ ≈ 4e-6 at
    # worst, while a bf16-rounded result would err ~2e-3: 1e-5 tells the two apart.
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(300, 4096, device="cuda", generator=g).bfloat16()
    w = torch.randn(1024, 4096, device="cuda", generator=g).bfloat16()
    out = linear_fp32(x, w)
    ref = x.double() @ w.double().t()
    assert out.dtype == torch.float32
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
