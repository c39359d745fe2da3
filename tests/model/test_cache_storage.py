"""Cache storage does not change numerics, and the window and pair-state layouts keep chunked
prefill, mixed batches and radix-style prefix sharing equal to one-shot prefill.

- codes + scales vs the same values stored dense (`store_values`), and a window pool vs a row per
  slot: bit-identical logits (the storage is all that differs);
- chunked / mixed in `qat` storage with a window pool: equal to one shot within 1e-5 relative
  (fp32 GEMMs of different row counts round differently, as in test_chunked.py), caches equal by
  position;
- a request sharing another's first p tokens (a radix-cache hit: its `req_to_token` row points
  at the other's slots; p odd and even) equals the request prefilled alone.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from dsv4cp.batch import PrefillBatch, RequestSlice, build_metadata
from dsv4cp.cache import KVCache
from dsv4cp.config import DeepseekV41Config
from dsv4cp.context import ForwardContext
from dsv4cp.cp.group import SingleCPGroup
from dsv4cp.model import DeepseekV41Model
from dsv4cp.runner import PrefillRunner

TOL = 1e-5


@pytest.fixture(scope="module")
def model() -> DeepseekV41Model:
    return DeepseekV41Model(DeepseekV41Config.tiny(), seed=1)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _runner(
    model: DeepseekV41Model, quant: str, *, window: int | None = 160, values: bool = False
) -> PrefillRunner:
    cache = KVCache(
        model.config,
        2048,
        quant=quant,  # type: ignore[arg-type]
        store_values=values,
        window_slots=window,
        max_requests=8,
        max_context=512,
        page_size=16,
    )
    return PrefillRunner(model, cache=cache)


def _chunked(runner: PrefillRunner, tokens: list[int], chunks: list[int]) -> Tensor:
    out, a = [], 0
    for n in chunks:
        got = runner.prefill({"a": tokens[a : a + n]}, return_all_logits=True).all_logits
        assert got is not None
        out.append(got)
        a += n
    return torch.cat(out)


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("quant", ["none", "qat"])
def test_storage_layout_does_not_change_numerics(model, quant) -> None:
    tokens, chunks = _prompt(130, 5), [17, 16, 97]
    codes = _chunked(_runner(model, quant), tokens, chunks)
    assert torch.equal(_chunked(_runner(model, quant, values=True), tokens, chunks), codes)
    assert torch.equal(_chunked(_runner(model, quant, window=None), tokens, chunks), codes)


def test_qat_storage_is_quantized_and_changes_the_logits(model) -> None:
    qat, none = _runner(model, "qat"), _runner(model, "none")
    tokens = _prompt(40, 6)
    a = _chunked(qat, tokens, [40])
    b = _chunked(none, tokens, [40])
    assert qat.cache.swa[0].dtype == torch.uint8 and qat.cache.swa[0].shape[1] == 96 + 3
    assert qat.cache.compressed[1].shape[1] == 48 + 6 and qat.cache.index[1].shape[1] == 32 + 2
    assert 1e-4 < _rel(a, b) < 0.5  # quantized keys move the logits, a little


@pytest.mark.parametrize("chunks", [[5, 32], [7, 30], [1, 1, 35], [17, 16, 4]])
def test_qat_windowed_chunked_prefill_equals_one_shot(model, chunks) -> None:
    tokens = _prompt(sum(chunks), sum(chunks))
    one = _runner(model, "qat")
    full = _chunked(one, tokens, [len(tokens)])
    chunked = _runner(model, "qat")
    assert _rel(_chunked(chunked, tokens, chunks), full) <= TOL
    for r in (one, chunked):
        assert r.alloc.swa_pages_held("a") < len(r.alloc.requests["a"].pages) or len(tokens) < 48
    _assert_caches_equal(chunked, one)


def _assert_caches_equal(a: PrefillRunner, b: PrefillRunner) -> None:
    views = []
    for r in (a, b):
        st = r.alloc.requests["a"]
        views.append(r.cache.slot_view(r.cache.req_to_token[st.row, : st.length]))
    for name, v in views[0].items():
        w = views[1][name]
        assert (_rel(v, w) <= TOL) if w.abs().max() > 0 else torch.equal(v, w), name


def test_qat_mixed_batch_equals_each_request_alone(model) -> None:
    prompts = {"x": _prompt(9, 1), "y": _prompt(130, 2), "z": _prompt(1, 3)}
    prefixes = {"x": 0, "y": 17, "z": 0}
    batch = _runner(model, "qat", window=256)  # three requests' windows and chunks at once
    batch.prefill({k: p[: prefixes[k]] for k, p in prompts.items() if prefixes[k]})
    out = batch.prefill({k: p[prefixes[k] :] for k, p in prompts.items()}, return_all_logits=True)
    assert out.all_logits is not None
    rows = 0
    for k, p in prompts.items():
        alone = _runner(model, "qat")
        ref = _chunked_rid(alone, k, p)[prefixes[k] :]
        n = len(p) - prefixes[k]
        assert _rel(out.all_logits[rows : rows + n], ref) <= TOL, k
        rows += n


def _chunked_rid(runner: PrefillRunner, rid: str, tokens: list[int]) -> Tensor:
    got = runner.prefill({rid: tokens}, return_all_logits=True).all_logits
    assert got is not None
    return got


# ---------------------------------------------------------------- radix-style prefix sharing
def _forward(
    model: DeepseekV41Model, cache: KVCache, row: int, start: int, tokens: list[int], slots: Tensor
) -> Tensor:
    """One request's forward as SGLang drives it: its req_to_token row already points at
    `slots` for the new positions (and at whatever slots hold its cached prefix)."""
    cache.req_to_token[row, start : start + len(tokens)] = slots
    batch = PrefillBatch((RequestSlice(row, row, start, tuple(tokens)),))
    meta = build_metadata(batch, cache.req_to_token, slots, [1, 2])
    ctx = ForwardContext.for_rank(meta, cache, SingleCPGroup())
    with torch.inference_mode():
        return model.logits(model.forward(batch.input_ids("cpu"), ctx))


@pytest.mark.parametrize("quant", ["none", "qat"])
@pytest.mark.parametrize("shared", [31, 32, 45])
def test_prefix_shared_request_equals_alone(model, quant, shared) -> None:
    """Every slot keeps its SWA key and even slots their pair state (window_slots=None), so a
    request may start at any prefix of another's tokens, odd lengths included."""
    a, b_own = _prompt(60, 7), _prompt(20, 8)
    b = a[:shared] + b_own
    cache = KVCache(model.config, 512, quant=quant, page_size=1, max_requests=4, max_context=128)
    _forward(model, cache, 0, 0, a, torch.arange(1, 61))
    cache.req_to_token[1, :shared] = cache.req_to_token[0, :shared]  # the radix-cache hit
    got = _forward(model, cache, 1, shared, b_own, torch.arange(100, 120))
    alone = KVCache(model.config, 512, quant=quant, page_size=1, max_requests=4, max_context=128)
    want = _forward(model, alone, 0, 0, b, torch.arange(1, 1 + len(b)))[shared:]
    assert _rel(got, want) <= TOL
