"""kernels/rowwise on CUDA at Flash dims: mHC's mix logits (x [T, 4, 5120] bf16, fn [24, 20480])
and the MoE gate (x [T, 5120] bf16, w [384, 5120]) against their twins within the fp32 order
bound (tests/kernels/test_rowwise_kernel.py says why), and row locality bit for bit: the rows of
a chunk or of an interleaved CP share give the bits of the one-shot call."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.kernels import rowwise as kernel
from dsv4cp.ops import hyper_connections as ops_hc
from dsv4cp.ops import rowwise as ops_rw

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # the order bound of tests/kernels/test_rowwise_kernel.py (three-TF32 products included)
    return (2 * x.shape[-1] * 2.0**-24 + 2.0**-20) * (x.double().abs() @ w.double().abs().t())


def _check(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, name: str) -> None:
    err = (got.double() - want.double()).abs()
    print(f"{name}: max err {float(err.max()):.3g}, max err/bound {float((err / bound).max()):.3g}")
    assert bool((err <= bound).all()), name


def test_gate_and_mix_logits_match_the_twins_and_stay_row_local() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    t = 4096
    x = torch.randn(t, 5120, device="cuda", generator=g).bfloat16()
    w = torch.randn(384, 5120, device="cuda", generator=g) / 70
    gate = kernel.rowwise_linear_fp32(x, w)
    _check(gate, ops_rw.rowwise_linear_fp32(x, w), _bound(x.float(), w), "gate")
    assert torch.equal(kernel.rowwise_linear_fp32(x[1::4], w), gate[1::4])  # a CP 4 rank
    assert torch.equal(kernel.rowwise_linear_fp32(x[1000:1777], w), gate[1000:1777])

    s = torch.randn(t, 4, 5120, device="cuda", generator=g).bfloat16()
    fn = torch.randn(24, 4 * 5120, device="cuda", generator=g) / 140
    mix = kernel.hc_mix_logits(s, fn, norm_eps=1e-6)
    want = ops_hc.hc_mix_logits(s, fn, norm_eps=1e-6)
    sf = s.flatten(1).float()
    rstd = torch.rsqrt(sf.square().mean(-1, keepdim=True) + 1e-6).double()
    _check(mix, want, _bound(sf, fn) * rstd + 4 * 2.0**-23 * want.double().abs(), "mix logits")
    assert torch.equal(kernel.hc_mix_logits(s[2::3], fn, norm_eps=1e-6), mix[2::3])
    assert torch.equal(kernel.hc_mix_logits(s[:1], fn, norm_eps=1e-6), mix[:1])
