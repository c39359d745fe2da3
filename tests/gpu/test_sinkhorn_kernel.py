"""mHC's Sinkhorn split kernel against its torch twin on CUDA at Flash dims: 16K tokens, H = 4,
20 iterations, eps = 1e-6. The bound is tests/kernels/test_sinkhorn_kernel.py's (derived there):
relative to the twin's |value|, pre 10u, post 8u, comb 12u + 4u·(iters − 1), u = 2⁻²⁴. On the GPU
both sides call CUDA's expf and IEEE division (libdevice in the kernel, the CUDA math library in
torch), so the values may well be bit-identical; the share that is is printed. Random logits
keep every value far above the subnormal range, which the kernel flushes to zero (Triton's
libdevice runs in ftz mode) and torch does not."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.kernels.sinkhorn import sinkhorn_split
from dsv4cp.ops import hyper_connections as ops_hc
from tests.kernels.test_sinkhorn_kernel import U, bounds, relative_diff

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("spread", [1.0, 3.0, 10.0])
def test_sinkhorn_split_matches_the_twin(spread: float) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    t, h, iters = 16384, 4, 20
    mix = (2 + h) * h
    logits = torch.randn(t, mix, device="cuda", generator=g) * spread
    scale = torch.rand(3, device="cuda", generator=g) + 0.5
    base = torch.randn(mix, device="cuda", generator=g)
    kw = {"hc_mult": h, "iters": iters, "eps": 1e-6}
    got = sinkhorn_split(logits, scale, base, **kw)
    want = ops_hc.sinkhorn_split(logits, scale, base, **kw)
    for name, a, b, bound in zip(("pre", "post", "comb"), got, want, bounds(iters)):
        d = relative_diff(a, b)
        same = float((a == b).float().mean())
        print(f"{name} (logits x{spread}): {same:.4%} bit-identical, max {d / U:.2f}u")
        assert d <= bound, (name, d / U, bound / U)
