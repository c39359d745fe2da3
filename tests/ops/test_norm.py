"""rms_norm against a per-row loop."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4cp.ops import rms_norm


def loop_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    rows = x.double().reshape(-1, x.shape[-1]).tolist()
    w = weight.double().tolist() if weight is not None else [1.0] * x.shape[-1]
    out = []
    for row in rows:
        inv = 1.0 / math.sqrt(sum(v * v for v in row) / len(row) + eps)
        out.append([v * inv * wi for v, wi in zip(row, w, strict=True)])
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape)


@pytest.mark.parametrize("eps", [1e-20, 1e-6], ids=["eps1e-20", "eps1e-6"])
@pytest.mark.parametrize("scale", [1.0, 1e-4], ids=["unit-scale", "tiny-scale"])
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no-weight"])
def test_rms_norm_matches_loop(eps: float, scale: float, with_weight: bool) -> None:
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(3, 5, 96, generator=gen) * scale
    weight = torch.randn(96, generator=gen) if with_weight else None
    before = x.clone()
    got = rms_norm(x, weight, eps)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.equal(x, before)
    torch.testing.assert_close(got.double(), loop_rms_norm(x, weight, eps), rtol=1e-5, atol=1e-7)


def test_eps_matters_for_small_inputs() -> None:
    x = torch.full((1, 8), 1e-4)
    # mean(x²) = 1e-8: eps 1e-20 normalizes to 1, eps 1e-6 shrinks by sqrt(1e-8 / (1e-8 + 1e-6))
    assert rms_norm(x, None, 1e-20).tolist()[0] == pytest.approx([1.0] * 8, rel=1e-6)
    assert rms_norm(x, None, 1e-6).tolist()[0] == pytest.approx(
        [1e-4 / math.sqrt(1e-8 + 1e-6)] * 8, rel=1e-5
    )


def test_zero_row_with_tiny_eps_is_zero() -> None:
    got = rms_norm(torch.zeros(2, 16), torch.ones(16), 1e-20)
    assert torch.equal(got, torch.zeros(2, 16))


@pytest.mark.parametrize(
    ("out_dtype", "want_dtype"),
    [
        pytest.param(None, torch.bfloat16, id="default-keeps-bf16"),
        pytest.param(torch.float32, torch.float32, id="fp32-out"),
    ],
)
def test_dtypes(out_dtype: torch.dtype | None, want_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    weight = torch.randn(64, generator=gen).to(torch.bfloat16)
    got = rms_norm(x, weight, 1e-20, out_dtype=out_dtype)
    assert got.dtype == want_dtype
    want = loop_rms_norm(x, weight, 1e-20)
    if want_dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)
    else:  # one rounding to bf16 from fp32
        assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 1e-6).all()
