"""linear_fp32: x · wᵀ with an fp32 result (SGLang's linear_bf16_fp32)."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.ops import linear_fp32
from dsv4cp.ops.matmul import MM_OUT_DTYPE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_is_the_fp32_product_of_the_operands(dtype: torch.dtype) -> None:
    # 9 rows: on the CPU each is computed as it is among many (ops.matmul.CPU_MIN_ROWS), so the
    # product equals those rows of a 64-row product, whatever kernel MKL picks for 9 rows alone
    torch.manual_seed(0)
    x, w = torch.randn(9, 64).to(dtype), torch.randn(24, 64).to(dtype)
    out = linear_fp32(x, w)
    assert out.dtype == torch.float32 and out.shape == (9, 24)
    many = torch.cat([torch.randn(30, 64).to(dtype), x, torch.randn(25, 64).to(dtype)])
    assert torch.equal(out, (many.float() @ w.float().t())[30:39])


def test_cpu_rows_do_not_depend_on_the_row_count() -> None:
    from dsv4cp.ops.matmul import linear_rows

    torch.manual_seed(1)
    x, w = torch.randn(150, 96), torch.randn(40, 96)
    full = linear_rows(x, w)
    for m in (1, 2, 3, 5, 7, 9, 11, 13, 16, 31):
        for a in (0, 3, 150 - m):
            assert torch.equal(linear_rows(x[a : a + m], w), full[a : a + m]), (m, a)
    assert torch.equal(linear_rows(x[:6].view(2, 3, 96), w), full[:6].view(2, 3, 40))
    assert linear_rows(x[:0], w).shape == (0, 40)


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
