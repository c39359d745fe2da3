"""kernels/fp8_dequant on CUDA at the attention projections' weight shapes (wq_b 32768 × 1280,
wo_b 5120 × 8192, wqkv_a 1792 × 5120) and a ragged one: bit for bit the torch twin — an e4m3
code times a power of two is exact in bf16 and fp32."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.kernels.fp8_dequant import dequant_fp8_blocks
from dsv4cp.ops import linear as ops_linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("n,k", [(32768, 1280), (5120, 8192), (1792, 5120), (1001, 530)])
def test_dequant_equals_the_twin_bit_for_bit(n: int, k: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(n)
    w = torch.randn(n, k, device="cuda", generator=g) * 100
    w = w.clamp(-448, 448).to(torch.float8_e4m3fn)  # beyond ±448 the cast gives NaN codes
    shape = ops_linear.fp8_scale_shape(n, k)
    s = torch.randint(110, 135, shape, device="cuda", generator=g, dtype=torch.int32)
    s = s.to(torch.uint8).view(torch.float8_e8m0fnu)
    for out in (torch.bfloat16, torch.float32):
        got = dequant_fp8_blocks(w, s, out_dtype=out)
        assert torch.equal(got, ops_linear.dequant_fp8_blocks(w, s, out_dtype=out)), out
