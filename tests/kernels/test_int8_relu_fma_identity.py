"""The identity behind `indexer_logits_int8`'s relu_fma form, on the CPU: for an exact int32
head sum S and a bf16 head weight w of either sign, the qat term bf16(relu(bf16(S)) · w) equals
sign(w) · relu(bf16(bf16(S) · |w|)) — what `fma.rn.relu.bf16x2` (the product rounded once,
then the relu) and the head sum's FFMA by ±1 form on the GPU (tests/kernels/test_mqa_logits.py
checks the kernel bit for bit there)."""

from __future__ import annotations

import torch


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def test_relu_then_product_equals_signed_relu_of_abs_product() -> None:
    g = torch.Generator().manual_seed(0)
    n = 1 << 20
    s = torch.randint(-(1 << 21), 1 << 21, (n,), generator=g).to(torch.float32)
    s[: n // 8] = torch.randint(-300, 300, (n // 8,), generator=g).to(torch.float32)  # near 0
    e = torch.randint(-60, 31, (n,), generator=g).to(torch.float32)
    w = _bf16(torch.randn(n, generator=g) * torch.exp2(e))
    w[::97] = 0.0
    w[1::89] = -0.0
    sb = _bf16(s)
    want = _bf16(torch.relu(sb) * w)
    got = torch.where(w < 0, -1.0, 1.0) * torch.relu(_bf16(sb * w.abs()))
    assert (w < 0).sum() > n // 3 and (sb < 0).sum() > n // 3
    assert torch.equal(got, want)  # +0 and -0 compare equal: a head sum from +0 ignores the sign
    # the acc's add: +0 + (±0) is +0, so the terms' zero signs never reach a logit
    acc = torch.zeros(n)
    assert torch.equal((acc + got).signbit(), (acc + want).signbit())
