"""swa_key / store_swa_k against a per-token loop (attention-math §4.3)."""

from __future__ import annotations

import cmath
import math
import re

import pytest
import torch

from dsv4cp.ops import YarnScaling, store_swa_k, swa_key

TINY_YARN = YarnScaling(factor=16.0, original_max_position=65536, beta_fast=32.0, beta_slow=1.0)
D, DR = 96, 32


def loop_omega(rope_dim: int, theta: float, yarn: YarnScaling | None) -> list[float]:
    out = []
    for i in range(rope_dim // 2):
        w0 = theta ** (-2.0 * i / rope_dim)
        if yarn is None:
            out.append(w0)
            continue

        def corr(n: float, yarn: YarnScaling = yarn) -> float:
            ratio = yarn.original_max_position / (2 * math.pi * n)
            return rope_dim * math.log(ratio) / (2 * math.log(theta))

        lo = max(math.floor(corr(yarn.beta_fast)), 0)
        hi = min(math.ceil(corr(yarn.beta_slow)), rope_dim - 1)
        hi_eff = hi + 0.001 if lo == hi else hi
        ramp = min(max((i - lo) / (hi_eff - lo), 0.0), 1.0)
        out.append(w0 / yarn.factor * ramp + w0 * (1.0 - ramp))
    return out


def loop_norm(kv_raw: torch.Tensor, weight: torch.Tensor, eps: float) -> list[list[float]]:
    w = weight.double().tolist()
    out = []
    for row in kv_raw.double().tolist():
        inv = 1.0 / math.sqrt(sum(v * v for v in row) / len(row) + eps)
        out.append([v * inv * wi for v, wi in zip(row, w, strict=True)])
    return out


def loop_rope(
    rows: list[list[float]], positions: list[int], theta: float, yarn: YarnScaling | None
) -> torch.Tensor:
    omega = loop_omega(DR, theta, yarn)
    out = []
    for row, pos in zip(rows, positions, strict=True):
        k = list(row)
        for i, om in enumerate(omega):
            z = complex(k[D - DR + 2 * i], k[D - DR + 2 * i + 1]) * cmath.exp(1j * pos * om)
            k[D - DR + 2 * i], k[D - DR + 2 * i + 1] = z.real, z.imag
        out.append(k)
    return torch.tensor(out, dtype=torch.float64)


def loop_swa_key(
    kv_raw: torch.Tensor,
    positions: list[int],
    weight: torch.Tensor,
    eps: float,
    theta: float,
    yarn: YarnScaling | None,
) -> torch.Tensor:
    return loop_rope(loop_norm(kv_raw, weight, eps), positions, theta, yarn)


ROPES = [
    pytest.param(10000.0, None, id="swa-layer-theta10k"),
    pytest.param(160000.0, TINY_YARN, id="compressed-layer-yarn"),
]
POSITIONS = [0, 1, 2, 15, 16, 33, 47, 63]


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(len(POSITIONS), D, generator=gen) * 3, torch.randn(D, generator=gen)


@pytest.mark.parametrize(("theta", "yarn"), ROPES)
@pytest.mark.parametrize("eps", [1e-20, 1e-6], ids=["eps1e-20", "eps1e-6"])
def test_swa_key_matches_loop(theta: float, yarn: YarnScaling | None, eps: float) -> None:
    kv_raw, weight = _inputs(20)
    got = swa_key(kv_raw, torch.tensor(POSITIONS), weight, eps, DR, theta, yarn, torch.float32)
    want = loop_swa_key(kv_raw, POSITIONS, weight, eps, theta, yarn)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(("theta", "yarn"), ROPES)
def test_store_swa_k_writes_only_slots(theta: float, yarn: YarnScaling | None) -> None:
    kv_raw, weight = _inputs(21)
    slots = torch.tensor([9, 3, 4, 12, 1, 7, 10, 5], dtype=torch.int64)
    cache = torch.full((14, D), 123.0)
    store_swa_k(kv_raw, torch.tensor(POSITIONS), slots, cache, weight, 1e-20, DR, theta, yarn)
    want = loop_swa_key(kv_raw, POSITIONS, weight, 1e-20, theta, yarn)
    torch.testing.assert_close(cache[slots].double(), want, rtol=1e-5, atol=2e-6)
    untouched = sorted(set(range(14)) - set(slots.tolist()))
    assert torch.equal(cache[untouched], torch.full((len(untouched), D), 123.0))


def test_store_swa_k_bf16_rounds_once() -> None:
    kv_raw, weight = _inputs(22)
    kv_raw = kv_raw.to(torch.bfloat16)
    slots = torch.arange(1, len(POSITIONS) + 1)
    cache = torch.zeros(len(POSITIONS) + 1, D, dtype=torch.bfloat16)
    pos = torch.tensor(POSITIONS)
    store_swa_k(kv_raw, pos, slots, cache, weight, 1e-20, DR, 160000.0, TINY_YARN)
    want = loop_swa_key(kv_raw, POSITIONS, weight, 1e-20, 160000.0, TINY_YARN)
    got = cache[1:].double()
    bound = 2**-8 * want.abs() + 1e-6  # a single round-to-nearest to bf16
    assert (got - want).abs().le(bound).all()
    assert torch.equal(cache[0], torch.zeros(D, dtype=torch.bfloat16))
    # rounding the norm to bf16 before RoPE (the reference order) breaks that bound
    normed = torch.tensor(loop_norm(kv_raw, weight, 1e-20)).to(torch.bfloat16).double()
    twice = loop_rope(normed.tolist(), POSITIONS, 160000.0, TINY_YARN).to(torch.bfloat16)
    assert not (twice.double() - want).abs().le(bound).all()


@pytest.mark.parametrize("impl", ["ops", "kernels"])
@pytest.mark.parametrize(
    ("fmt", "quant", "message"),
    [
        ("fp4_ue8m0_32", "qat", "the SWA cache is dense or fp8_ue8m0_32, got fp4_ue8m0_32"),
        ("fp8_ue8m0_32", "none", "a quantized SWA cache needs quant='qat'"),
    ],
)
def test_swa_key_rows_refuses_a_cache_it_cannot_fill(
    impl: str, fmt: str, quant: str, message: str
) -> None:
    # The Triton wrapper checks before it launches anything: CPU tensors reach the same errors.
    if impl == "kernels":
        pytest.importorskip("triton")
        from dsv4cp.kernels.swa import swa_key_rows
    else:
        from dsv4cp.ops import swa_key_rows
    x = torch.randn(4, 64).bfloat16()
    with pytest.raises(ValueError, match=re.escape(message)):
        swa_key_rows(x, torch.arange(4), None, 1e-6, 16, 1e4, None, quant, fmt, torch.uint8)
