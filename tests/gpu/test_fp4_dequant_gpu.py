"""kernels/fp4_dequant on CUDA at the MoE's launch shape (32 experts × 2304 rows × 5120, and a
ragged row count): bit for bit the torch twin — every e2m1 code times a power of two is exact
in bf16 and fp32, so the two must agree exactly."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.kernels.fp4_dequant import dequant_fp4
from dsv4cp.ops import linear as ops_linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("rows", [32 * 2304, 1001])
def test_dequant_equals_the_twin_bit_for_bit(rows: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows)
    k = 5120
    packed = torch.randint(0, 256, (rows, k // 2), device="cuda", generator=g, dtype=torch.int32)
    packed = packed.to(torch.uint8)
    scale = torch.randint(110, 135, (rows, k // 32), device="cuda", generator=g, dtype=torch.int32)
    scale = scale.to(torch.uint8).view(torch.float8_e8m0fnu)
    for out in (torch.bfloat16, torch.float32):
        want = ops_linear.dequant_fp4(packed, scale, out_dtype=out)
        assert torch.equal(dequant_fp4(packed, scale, out_dtype=out), want), out
