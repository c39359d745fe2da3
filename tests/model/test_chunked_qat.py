"""quant="qat": chunked prefill and mixed batches equal one-shot prefill.

The fixture checkpoint's attention layers as a residual chain (tests/model/qat_scenarios.py);
rows of a request are compared across runs that cut it into different steps, with its cache rows.
Equal means bit for bit except the fp32 pair state, which may differ in fp32 reduction order
(`qat_scenarios.mismatches`; measured: all bf16 rows and top-k identical, pair state within
4.8e-7 of values up to 3.5).
"""

from __future__ import annotations

import pytest

from tests.model.qat_scenarios import by_token, chunked, mismatches, prompts, run_steps

PROMPT = prompts((61,), seed=1)
CHUNKINGS = [[5, 56], [6, 55], [17, 16, 28], [1, 1, 59], [16, 1, 1, 43], [2] * 30 + [1]]


def _run(sizes: dict[str, list[int]], prompt: dict[str, tuple[int, ...]] = PROMPT):
    steps = chunked(prompt, sizes)
    return by_token(run_steps(None, steps), steps)


@pytest.mark.parametrize("sizes", CHUNKINGS, ids=["+".join(map(str, c)) for c in CHUNKINGS])
def test_chunked_prefill_equals_one_shot(sizes: list[int]) -> None:
    want, got = _run({"r0": [61]}), _run({"r0": sizes})
    assert not mismatches(got, want)


def test_mixed_batch_equals_each_request_alone() -> None:
    prompt = prompts((9, 40, 1, 61), seed=2)
    mixed = _run({"r0": [4, 5], "r1": [17, 23], "r2": [1], "r3": [30, 31]}, prompt)
    for rid, toks in prompt.items():
        alone = _run({rid: [len(toks)]}, {rid: toks})
        assert not mismatches({k: mixed[k] for k in alone}, alone), rid
