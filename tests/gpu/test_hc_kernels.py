"""mHC's collapse and expand kernels against their torch twins on CUDA at Flash dims (H = 4,
d = 5120, bf16 and fp32, 2K tokens). Both sum the same rounded fp32 products; the kernels
sequentially from stream 0 (bit for bit the twin on CPU, tests/kernels), CUDA torch in its
reduction's order, so the bound is the fp32 sums' order bound H·2⁻²⁴·Σ|terms| plus one rounding
of the output dtype; the share of outputs that are bit-identical is printed."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.kernels.hyper_connections import hc_collapse, hc_expand
from dsv4cp.ops import hyper_connections as ops_hc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _within(got: torch.Tensor, want: torch.Tensor, terms: torch.Tensor, name: str) -> None:
    eps = torch.finfo(got.dtype).eps
    big = torch.maximum(got.float().abs(), want.float().abs()).clamp_min(1e-30)
    one_rounding = eps * torch.exp2(torch.floor(torch.log2(big)))
    bound = 4 * 2.0**-24 * terms + one_rounding
    same = float((got == want).float().mean())
    print(f"{name} {got.dtype}: {same:.4%} bit-identical")
    assert bool(((got.float() - want.float()).abs() <= bound).all()), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_collapse_and_expand_match_the_twins(dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    t, h, d = 2048, 4, 5120
    x = torch.randn(t, h, d, device="cuda", generator=g).to(dtype)
    y = torch.randn(t, d, device="cuda", generator=g).to(dtype)
    pre = torch.rand(t, h, device="cuda", generator=g)
    post = 2 * torch.rand(t, h, device="cuda", generator=g)
    comb = torch.rand(t, h, h, device="cuda", generator=g)
    terms = (pre[..., None] * x.float().abs()).sum(1)
    _within(hc_collapse(x, pre), ops_hc.hc_collapse(x, pre), terms, "collapse")
    terms = post[..., None] * y.float().abs()[:, None] + torch.einsum(
        "tij,tid->tjd", comb, x.float().abs()
    )
    _within(hc_expand(y, x, post, comb), ops_hc.hc_expand(y, x, post, comb), terms, "expand")
