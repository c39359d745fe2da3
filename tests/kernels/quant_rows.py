"""Rows that stress the block quantizers (fp8/fp4, ue8m0/e4m3 scales), shared by the interpreter
tests of the fake quant and of the encoded stores."""

from __future__ import annotations

import torch
from torch import Tensor


def adversarial_rows(d: int = 64) -> Tensor:
    """[8, d] bf16: zeros (amax floors), tiny blocks, e4m3-scale saturation (amax/6 > 448), exact
    e2m1 midpoints of the scale, -0.0 (sign bits), subnormal e4m3 codes, one lone value."""
    rows = torch.zeros(8, d)
    rows[1] = 1e-30
    rows[2] = torch.linspace(-5000, 5000, d)
    rows[3, ::2] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * (d // 16))
    rows[3, 1::2] = -rows[3, ::2]
    rows[4] = -0.0
    rows[5] = torch.randn(d) * 2.0**-20
    rows[6] = torch.randn(d) * 448
    rows[7, 7] = 3.0
    return rows.bfloat16()
