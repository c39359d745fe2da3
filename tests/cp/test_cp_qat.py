"""quant="qat": CP = 2, 3, 4 (fake ranks) and CP = 2 (gloo processes) equal CP = 1.

The fixture checkpoint's 7 attention layers (every V4.1 layer role) run as a residual chain in
bf16 with the reference's fp8/fp4 steps (tests/model/qat_scenarios.py). Every quantizer is
row-local and the fp8 GEMM twin sums each 32-block exactly, so a rank's local rows compute what
CP = 1 computes: every layer's hidden rows, every top-k and every bf16 cache row bit for bit; the
fp32 pair state up to the reduction order of its fp32 GEMM (`qat_scenarios.mismatches`). Measured:
bit-identical everywhere but the pair state (max 4.8e-7 of values up to 3.5, where CPU BLAS
blocks by row count).
"""

from __future__ import annotations

import pytest
from torch import Tensor

from dsv4cp.cp.launch import run_cp
from tests.model.qat_scenarios import Steps, chunked, mismatches, prompts, run_steps

PROMPT = prompts((5, 31, 61))
SCENARIOS = {
    "one-shot": chunked(PROMPT, {r: [len(t)] for r, t in PROMPT.items()}),
    "prefix-chunks": chunked(PROMPT, {"r0": [2, 3], "r1": [7, 24], "r2": [17, 16, 28]}),
    "single-tokens": chunked(PROMPT, {"r0": [1, 1, 3], "r1": [30, 1], "r2": [1, 60]}),
}
_CP1: dict[str, dict[str, Tensor]] = {}


def cp1(name: str) -> dict[str, Tensor]:
    if name not in _CP1:
        _CP1[name] = run_steps(None, SCENARIOS[name])
    return _CP1[name]


def assert_identical(got: dict[str, Tensor], want: dict[str, Tensor]) -> None:
    differ = mismatches(got, want)
    assert not differ, differ[:10]


def run(cp: int, steps: Steps, backend: str) -> list[dict[str, Tensor]]:
    return run_cp(cp, run_steps, steps, backend=backend, timeout_s=120)


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_fake_cp_equals_cp1_bit_for_bit(name: str, cp: int) -> None:
    ranks = run(cp, SCENARIOS[name], "fake")
    for got in ranks:  # global rows and the replicated caches: the same on every rank
        assert_identical(got, cp1(name))


def test_gloo_cp2_equals_cp1_bit_for_bit() -> None:
    ranks = run(2, SCENARIOS["prefix-chunks"], "gloo")
    for got in ranks:
        assert_identical(got, cp1("prefix-chunks"))
