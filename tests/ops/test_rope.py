"""apply_rope / rope_inv_freq / rope_cos_sin against hand loops (attention-math §3)."""

from __future__ import annotations

import cmath
import math

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from dsv4cp.ops import YarnScaling, apply_rope, rope_cos_sin, rope_inv_freq, rope_tail_

REAL_YARN = YarnScaling(factor=16.0, original_max_position=65536, beta_fast=32.0, beta_slow=1.0)
# beta_slow chosen so that corr(beta_slow) is in (-1, 0]: lo == hi == 0, the +0.001 branch
DEGENERATE_YARN = YarnScaling(factor=4.0, original_max_position=64, beta_fast=32.0, beta_slow=11.3)


def loop_band(rope_dim: int, theta: float, yarn: YarnScaling) -> tuple[int, int]:
    def corr(n_rot: float) -> float:
        return (
            rope_dim
            * math.log(yarn.original_max_position / (2 * math.pi * n_rot))
            / (2 * math.log(theta))
        )

    lo = max(math.floor(corr(yarn.beta_fast)), 0)
    hi = min(math.ceil(corr(yarn.beta_slow)), rope_dim - 1)
    return lo, hi


def loop_omega(rope_dim: int, theta: float, yarn: YarnScaling | None) -> list[float]:
    out = []
    for i in range(rope_dim // 2):
        w0 = theta ** (-2.0 * i / rope_dim)
        if yarn is None:
            out.append(w0)
            continue
        lo, hi = loop_band(rope_dim, theta, yarn)
        hi_eff = hi + 0.001 if lo == hi else hi
        ramp = min(max((i - lo) / (hi_eff - lo), 0.0), 1.0)
        out.append(w0 / yarn.factor * ramp + w0 * (1.0 - ramp))
    return out


def loop_rotate(
    vec: list[float], pos: int, omega: list[float], rope_dim: int, inverse: bool, fp32_angle: bool
) -> list[float]:
    out = list(vec)
    base = len(vec) - rope_dim
    sign = -1.0 if inverse else 1.0
    for i, w in enumerate(omega):
        ang = float(np.float32(pos) * np.float32(w)) if fp32_angle else pos * w
        z = complex(vec[base + 2 * i], vec[base + 2 * i + 1]) * cmath.exp(1j * sign * ang)
        out[base + 2 * i], out[base + 2 * i + 1] = z.real, z.imag
    return out


def loop_apply(
    x: torch.Tensor,
    positions: list[int],
    omega: list[float],
    rope_dim: int,
    inverse: bool = False,
    fp32_angle: bool = False,
) -> torch.Tensor:
    flat = x.double().reshape(x.shape[0], -1, x.shape[-1])
    rows = []
    for t, pos in enumerate(positions):
        rows.append(
            [
                loop_rotate(flat[t, h].tolist(), pos, omega, rope_dim, inverse, fp32_angle)
                for h in range(flat.shape[1])
            ]
        )
    return torch.tensor(rows, dtype=torch.float64).reshape(x.shape)


OMEGA_CASES = [
    pytest.param(64, 160000.0, REAL_YARN, id="real-Dr64-theta160k-yarn"),
    pytest.param(32, 160000.0, REAL_YARN, id="tiny-Dr32-theta160k-yarn"),
    pytest.param(64, 10000.0, None, id="swa-Dr64-theta10k-plain"),
    pytest.param(32, 10000.0, None, id="tiny-Dr32-theta10k-plain"),
    pytest.param(64, 160000.0, DEGENERATE_YARN, id="degenerate-band-lo-eq-hi"),
]


@pytest.mark.parametrize(("rope_dim", "theta", "yarn"), OMEGA_CASES)
def test_inv_freq_matches_loop(rope_dim: int, theta: float, yarn: YarnScaling | None) -> None:
    got = rope_inv_freq(rope_dim, theta, yarn)
    assert got.dtype == torch.float32 and got.shape == (rope_dim // 2,)
    want = torch.tensor(loop_omega(rope_dim, theta, yarn), dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize(
    ("rope_dim", "lo", "hi"),
    [pytest.param(64, 15, 25, id="real-Dr64"), pytest.param(32, 7, 13, id="tiny-Dr32")],
)
def test_yarn_band(rope_dim: int, lo: int, hi: int) -> None:
    assert loop_band(rope_dim, 160000.0, REAL_YARN) == (lo, hi)
    got = rope_inv_freq(rope_dim, 160000.0, REAL_YARN).double().tolist()
    for i, w in enumerate(got):
        w0 = 160000.0 ** (-2.0 * i / rope_dim)
        if i <= lo:
            assert w == pytest.approx(w0, rel=1e-6), i
        elif i >= hi:
            assert w == pytest.approx(w0 / 16.0, rel=1e-6), i
        else:
            assert w0 / 16.0 * (1 + 1e-3) < w < w0 * (1 - 1e-3), i


def test_degenerate_band_uses_hi_plus_epsilon() -> None:
    assert loop_band(64, 160000.0, DEGENERATE_YARN) == (0, 0)
    got = rope_inv_freq(64, 160000.0, DEGENERATE_YARN).double().tolist()
    assert got[0] == 1.0
    for i in range(1, 32):
        assert got[i] == pytest.approx(160000.0 ** (-2.0 * i / 64) / 4.0, rel=1e-6), i


@pytest.mark.parametrize(
    ("rope_dim", "theta", "yarn"),
    [OMEGA_CASES[1], OMEGA_CASES[2]],
)
def test_cos_sin_matches_loop(rope_dim: int, theta: float, yarn: YarnScaling | None) -> None:
    positions = [0, 1, 2, 7, 31, 40]
    cos, sin = rope_cos_sin(torch.tensor(positions), rope_dim, theta, yarn)
    assert cos.dtype == sin.dtype == torch.float32
    assert cos.shape == sin.shape == (len(positions), rope_dim // 2)
    omega = loop_omega(rope_dim, theta, yarn)
    want_cos = torch.tensor([[math.cos(p * w) for w in omega] for p in positions])
    want_sin = torch.tensor([[math.sin(p * w) for w in omega] for p in positions])
    torch.testing.assert_close(cos.double(), want_cos.double(), rtol=0.0, atol=5e-6)
    torch.testing.assert_close(sin.double(), want_sin.double(), rtol=0.0, atol=5e-6)


ROTATION_CASES = [
    pytest.param((6, 96), 32, id="TD-tiny"),
    pytest.param((5, 3, 96), 32, id="THD-tiny"),
    pytest.param((4, 2, 3, 128), 64, id="T23D-real-rope"),
    pytest.param((3, 2, 32), 32, id="rope-only-no-nope-dims"),
]


@pytest.mark.parametrize(("shape", "rope_dim"), ROTATION_CASES)
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize("yarn", [None, REAL_YARN], ids=["plain", "yarn"])
def test_apply_rope_matches_complex_loop(
    shape: tuple[int, ...], rope_dim: int, inverse: bool, yarn: YarnScaling | None
) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen)
    positions = [0, 1, 5, 17, 40, 63][: shape[0]]
    got = apply_rope(x, torch.tensor(positions), rope_dim, 160000.0, yarn, inverse=inverse)
    assert got.dtype == x.dtype and got.shape == x.shape
    want = loop_apply(x, positions, loop_omega(rope_dim, 160000.0, yarn), rope_dim, inverse)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6)


def test_nope_dims_untouched_and_dtype_kept() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3, 96, generator=gen).to(torch.bfloat16)
    before = x.clone()
    got = apply_rope(x, torch.tensor([3, 9, 100, 5000]), 32, 160000.0, REAL_YARN)
    assert got.dtype == torch.bfloat16
    assert torch.equal(x, before)
    assert torch.equal(got[..., :64], x[..., :64])
    assert not torch.equal(got[..., 64:], x[..., 64:])


@pytest.mark.parametrize("yarn", [None, REAL_YARN], ids=["plain", "yarn"])
def test_inverse_undoes_rope(yarn: YarnScaling | None) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4, 128, generator=gen)
    pos = torch.tensor([0, 1, 129, 65535, 65536, 1_000_000])
    there = apply_rope(x, pos, 64, 160000.0, yarn)
    back = apply_rope(there, pos, 64, 160000.0, yarn, inverse=True)
    assert not torch.allclose(there, x)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)


def test_large_positions_without_tables() -> None:
    gen = torch.Generator().manual_seed(4)
    positions = [0, 1, 65535, 65536, 999_999, 1_000_000, 1_048_575]
    x = torch.randn(len(positions), 2, 128, generator=gen)
    pos = torch.tensor(positions)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        got = apply_rope(x, pos, 64, 160000.0, REAL_YARN)
    biggest = max(abs(e.cpu_memory_usage) for e in prof.events())
    assert biggest < 1 << 20, f"apply_rope allocated {biggest} bytes at once"
    # At p ~ 1e6 the fp32 angle p·ω is sensitive to ω's last bit; ω itself is checked against
    # the hand loop above, so the loop here forms the angle in fp32 from the fp32 ω.
    omega = rope_inv_freq(64, 160000.0, REAL_YARN).tolist()
    want = loop_apply(x, positions, omega, 64, fp32_angle=True)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=5e-6)


def test_bad_arguments() -> None:
    x = torch.zeros(2, 96)
    with pytest.raises(ValueError, match="even"):
        apply_rope(x, torch.tensor([0, 1]), 31, 10000.0)
    with pytest.raises(ValueError, match="exceeds"):
        apply_rope(x, torch.tensor([0, 1]), 128, 10000.0)
    with pytest.raises(ValueError, match="positions"):
        apply_rope(x, torch.tensor([0, 1, 2]), 32, 10000.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_tail_in_place_equals_apply_rope(dtype: torch.dtype, inverse: bool) -> None:
    torch.manual_seed(3)
    x = torch.randn(7, 3, 40).to(dtype)
    pos = torch.tensor([0, 1, 5, 9, 100, 4096, 70000])
    want = apply_rope(x, pos, 16, 10000.0, REAL_YARN, inverse=inverse)
    head = x[..., :24].clone()
    got = rope_tail_(x, pos, 16, 10000.0, REAL_YARN, inverse=inverse)
    assert got is x
    assert torch.equal(x, want)
    assert torch.equal(x[..., :24], head)
