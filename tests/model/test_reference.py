"""The whole tiny model against an independent naive fp64 implementation (tests/reference_model)."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.config import DeepseekV41Config
from dsv4cp.model import DeepseekV41Model
from dsv4cp.runner import PrefillRunner
from tests.reference_model import reference_logits

LENS = [1, 2, 3, 7, 8, 9, 31, 33, 127, 128, 129]


@pytest.fixture(scope="module")
def model() -> DeepseekV41Model:
    return DeepseekV41Model(DeepseekV41Config.tiny(), seed=0)


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check(model: DeepseekV41Model, n: int) -> None:
    tokens = _prompt(n, n, model.config.vocab_size)
    runner = PrefillRunner(model, num_slots=1024, max_context=512)
    got = runner.prefill({"a": tokens}, return_all_logits=True).all_logits
    ref = reference_logits(model.config, model.checkpoint_weights(), tokens)
    err = (got.double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-5, f"length {n}: max relative error {err:.3g} vs the naive reference"


@pytest.mark.parametrize("n", LENS, ids=[f"T{n}" for n in LENS])
def test_full_prefill_matches_naive_reference(model: DeepseekV41Model, n: int) -> None:
    _check(model, n)


@pytest.mark.slow
def test_full_prefill_matches_naive_reference_300(model: DeepseekV41Model) -> None:
    _check(model, 300)
