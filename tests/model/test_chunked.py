"""Chunked prefill, mixed batches and decode all equal one-shot prefill (fp32, 1e-5 relative), for
the dense tiny decoder and for `tiny_full` (mHC + MoE: the experts' fp32 GEMMs sum in an order
that depends on the rows per call, tests/model/test_whole_model.py)."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.config import DeepseekV41Config
from dsv4cp.model import DeepseekV41Model
from dsv4cp.runner import PrefillRunner

TOL = 1e-5


@pytest.fixture(scope="module", params=["tiny", "tiny_full"])
def model(request) -> DeepseekV41Model:
    return DeepseekV41Model(getattr(DeepseekV41Config, request.param)(), seed=1)


def _runner(model: DeepseekV41Model) -> PrefillRunner:
    return PrefillRunner(model, num_slots=2048, max_context=512, max_requests=8)


def _prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _cache_rows(runner: PrefillRunner, rid: str) -> dict[str, torch.Tensor]:
    """Every cache row of the request (pair state included: every even token keeps one)."""
    st = runner.alloc.requests[rid]
    slots = runner.cache.req_to_token[st.row, : st.length]
    return runner.cache.slot_view(slots)


def _assert_caches_equal(a: PrefillRunner, ra: str, b: PrefillRunner, rb: str) -> None:
    ca, cb = _cache_rows(a, ra), _cache_rows(b, rb)
    for name in ca:
        assert (
            _rel(ca[name], cb[name]) <= TOL
            if cb[name].abs().max() > 0
            else torch.equal(ca[name], cb[name])
        ), name


CHUNKINGS = [
    (37, [5, 32]),
    (37, [6, 31]),
    (37, [7, 30]),
    (40, [5, 6, 7, 22]),
    (130, [17, 16, 97]),  # crosses the 16-token window and 4-entry candidate blocks
    (130, [1, 1, 128]),
    (300, [129, 2, 169]),
]


@pytest.mark.parametrize(
    "total,chunks", CHUNKINGS, ids=[f"{t}-{'+'.join(map(str, c))}" for t, c in CHUNKINGS]
)
def test_chunked_prefill_equals_one_shot(model, total, chunks) -> None:
    tokens = _prompt(total, total)
    one = _runner(model)
    full = one.prefill({"a": tokens}, return_all_logits=True).all_logits
    chunked = _runner(model)
    got, a = [], 0
    for n in chunks:
        got.append(chunked.prefill({"a": tokens[a : a + n]}, return_all_logits=True).all_logits)
        a += n
    assert _rel(torch.cat(got), full) <= TOL
    _assert_caches_equal(chunked, "a", one, "a")


def test_mixed_batch_equals_each_request_alone(model) -> None:
    prompts = {"x": _prompt(9, 1), "y": _prompt(130, 2), "z": _prompt(1, 3)}
    prefixes = {"x": 0, "y": 17, "z": 0}
    batch = _runner(model)
    pre = {k: p[: prefixes[k]] for k, p in prompts.items() if prefixes[k]}
    batch.prefill(pre)
    out = batch.prefill({k: p[prefixes[k] :] for k, p in prompts.items()}, return_all_logits=True)
    rows = 0
    for k, p in prompts.items():
        alone = _runner(model)
        ref = alone.prefill({k: p}, return_all_logits=True).all_logits[prefixes[k] :]
        n = len(p) - prefixes[k]
        assert _rel(out.all_logits[rows : rows + n], ref) <= TOL, k
        _assert_caches_equal(batch, k, alone, k)
        rows += n


def test_decode_equals_prefill_of_longer_prompt(model) -> None:
    prompt = _prompt(20, 4)
    runner = _runner(model)
    gen = runner.generate([prompt], max_new_tokens=6)[0]
    full = _runner(model).prefill({"a": prompt + gen}, return_all_logits=True).all_logits
    # Greedy: each generated token is the argmax of the longer prompt's logits at its position.
    assert full[len(prompt) - 1 : -1].argmax(-1).tolist() == gen
    dec = _runner(model)
    dec.prefill({"a": prompt})
    steps = [dec.decode({"a": t}).logits[0] for t in gen]
    assert _rel(torch.stack(steps), full[len(prompt) :]) <= TOL
