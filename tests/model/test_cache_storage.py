"""Cache storage does not change numerics, and the window and pair-state layouts keep chunked
prefill, mixed batches and radix-style prefix sharing equal to one-shot prefill.

- codes + scales vs the same values stored dense (`store_values`), and a window pool vs a row per
  slot: bit-identical logits (the storage is all that differs);
- chunked / mixed with a window pool: in exact math ("none") equal to one shot within 1e-5
  relative (fp32 GEMMs of different row counts round differently, as in test_chunked.py), caches
  equal by position; in qat bit-identical to the same chunks with a row per slot;
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


def _model(quant: str) -> DeepseekV41Model:
    """The tiny random model with every attention layer in `quant` numerics."""
    m = DeepseekV41Model(DeepseekV41Config.tiny(), seed=1)
    for block in m.blocks:
        block.attn.quant = quant  # type: ignore[assignment]
    m.quant = quant  # type: ignore[attr-defined]  # what the runner sizes its cache for
    return m


MODELS = {q: _model(q) for q in ("none", "qat")}


@pytest.fixture(scope="module")
def model() -> DeepseekV41Model:
    return MODELS["qat"]


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
def test_storage_layout_does_not_change_numerics(quant) -> None:
    model = MODELS[quant]
    tokens, chunks = _prompt(130, 5), [17, 16, 97]
    codes = _chunked(_runner(model, quant), tokens, chunks)
    assert torch.equal(_chunked(_runner(model, quant, values=True), tokens, chunks), codes)
    assert torch.equal(_chunked(_runner(model, quant, window=None), tokens, chunks), codes)


def test_qat_storage_is_quantized_and_changes_the_logits() -> None:
    qat, none = _runner(MODELS["qat"], "qat"), _runner(MODELS["none"], "none")
    tokens = _prompt(40, 6)
    a = _chunked(qat, tokens, [40])
    b = _chunked(none, tokens, [40])
    assert qat.cache.swa[0].dtype == torch.uint8 and qat.cache.swa[0].shape[1] == 96 + 3
    assert qat.cache.compressed[1].shape[1] == 48 + 6 and qat.cache.index[1].shape[1] == 32 + 2
    assert 1e-4 < _rel(a, b) < 0.5  # quantized keys move the logits, a little


@pytest.mark.parametrize("chunks", [[5, 32], [7, 30], [1, 1, 35], [17, 16, 4], [129, 2, 169]])
def test_windowed_chunked_prefill_equals_one_shot(chunks) -> None:
    """quant "none" (exact math): the window pool keeps what later chunks read."""
    model = MODELS["none"]
    tokens = _prompt(sum(chunks), sum(chunks))
    one = _runner(model, "none", window=320)
    full = _chunked(one, tokens, [len(tokens)])
    chunked = _runner(model, "none", window=224)  # the window and a chunk of 169
    assert _rel(_chunked(chunked, tokens, chunks), full) <= TOL
    if len(tokens) > 48:  # pages older than the window were handed back
        assert chunked.alloc.swa_pages_held("a") < len(chunked.alloc.requests["a"].pages)
    _assert_caches_equal(chunked, one)


@pytest.mark.parametrize("chunks", [[5, 32], [7, 30], [1, 1, 35], [17, 16, 4]])
def test_qat_windowed_chunks_equal_every_slot_chunks(chunks) -> None:
    """qat: the same chunks with a window pool and with a row per slot are bit-identical.
    (Chunked vs one-shot qat differs where fp32 GEMMs of other row counts flip a code; that is
    the numerics, not the storage.)"""
    model = MODELS["qat"]
    tokens = _prompt(sum(chunks), sum(chunks))
    window = _chunked(_runner(model, "qat"), tokens, chunks)
    assert torch.equal(_chunked(_runner(model, "qat", window=None), tokens, chunks), window)


def _assert_caches_equal(a: PrefillRunner, b: PrefillRunner) -> None:
    views = []
    for r in (a, b):
        st = r.alloc.requests["a"]
        views.append(r.cache.slot_view(r.cache.req_to_token[st.row, : st.length]))
    for name, v in views[0].items():
        w = views[1][name]
        assert (_rel(v, w) <= TOL) if w.abs().max() > 0 else torch.equal(v, w), name


@pytest.mark.parametrize("quant", ["none", "qat"])
def test_mixed_batch_with_a_window_pool(quant) -> None:
    """Three requests in one batch, one with a cached prefix: window pool = a row per slot
    (bit-identical), and in exact math each request equals itself alone."""
    model = MODELS[quant]
    prompts = {"x": _prompt(9, 1), "y": _prompt(130, 2), "z": _prompt(1, 3)}
    prefixes = {"x": 0, "y": 17, "z": 0}
    outs = []
    for window in (256, None):  # 256: three requests' windows and chunks at once
        batch = _runner(model, quant, window=window)
        batch.prefill({k: p[: prefixes[k]] for k, p in prompts.items() if prefixes[k]})
        new = {k: p[prefixes[k] :] for k, p in prompts.items()}
        outs.append(batch.prefill(new, return_all_logits=True).all_logits)
    assert torch.equal(outs[0], outs[1])
    if quant == "qat":
        return
    rows = 0
    for k, p in prompts.items():
        ref = _chunked_rid(_runner(model, quant), k, p)[prefixes[k] :]
        n = len(p) - prefixes[k]
        assert _rel(outs[0][rows : rows + n], ref) <= TOL, k
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
def test_prefix_shared_request_equals_alone(quant, shared) -> None:
    """Every slot keeps its SWA key and even slots their pair state (window_slots=None), so a
    request may start at any prefix of another's tokens, odd lengths included."""
    model = MODELS[quant]
    a, b_own = _prompt(60, 7), _prompt(20, 8)
    b = a[:shared] + b_own
    cache = KVCache(model.config, 512, quant=quant, page_size=1, max_requests=4, max_context=128)
    _forward(model, cache, 0, 0, a, torch.arange(1, 61))
    cache.req_to_token[1, :shared] = cache.req_to_token[0, :shared]  # the radix-cache hit
    got = _forward(model, cache, 1, shared, b_own, torch.arange(100, 120))
    alone = KVCache(model.config, 512, quant=quant, page_size=1, max_requests=4, max_context=128)
    want = _forward(model, alone, 0, 0, b, torch.arange(1, 1 + len(b)))[shared:]
    assert _rel(got, want) <= TOL


# ---------------------------------------------------------------- the fixture checkpoint, qat
def _fixture_stack_runs(cp: int, store_values: bool = False) -> list[tuple]:
    """Every rank's (outputs of two chunks, cache tensors) for the fixture's layers in qat."""
    from dsv4cp.cp.fake import FakeCPWorld, run_ranks
    from tests.model import dsv41_fixture as fx
    from tests.model.attention_stack import AttentionStack, load_attention, run_teacher_forced

    cfg = DeepseekV41Config.from_hf(fx.CHECKPOINT)
    n_layers = cfg.num_hidden_layers
    layers = [load_attention(cfg, fx.reader(), i, quant="qat") for i in range(n_layers)]
    ref = fx.reference()
    inputs = {i: ref[f"block{i}.attn_in"][0].bfloat16() for i in range(n_layers)}
    ids = ref["input_ids"][0].tolist()
    cut = 37

    def body(group):  # noqa: ANN001, ANN202
        stack = AttentionStack(cfg, layers, cp=group, store_values=store_values)
        first = {i: v[:cut] for i, v in inputs.items()}
        rest = {i: v[cut:] for i, v in inputs.items()}
        out = stack.step({"a": ids[:cut]}, run_teacher_forced(layers, first))
        out2 = stack.step({"a": ids[cut:]}, run_teacher_forced(layers, rest))
        st = stack.alloc.requests["a"]
        rows = stack.cache.slot_view(stack.cache.req_to_token[st.row, : st.length])
        raw = {k: v.clone() for k, v in stack.cache.state_dict_view().items()}
        return {**out, **{f"{k}/2": v for k, v in out2.items()}}, rows, raw

    return run_ranks(FakeCPWorld(cp, timeout_s=120), body)


def test_fixture_qat_codes_equal_values_storage_and_cp() -> None:
    """The fixture's attention in qat (bf16) with codes + scales: bit-identical to the same
    numerics with dequantized values stored dense, and CP = 2, 3 (fake) bit-identical to CP = 1,
    the stored codes included (each rank quantizes its own SWA rows before the gather)."""
    ref_out, ref_rows, ref_raw = _fixture_stack_runs(1)[0]
    assert ref_raw["swa.0"].dtype == torch.uint8
    val_out, val_rows, _ = _fixture_stack_runs(1, store_values=True)[0]
    for k, v in ref_out.items():
        assert torch.equal(val_out[k], v), k
    for k, v in ref_rows.items():
        assert torch.equal(val_rows[k], v), k
    for cp in (2, 3):
        for out, _, raw in _fixture_stack_runs(cp):
            assert all(torch.equal(out[k], v) for k, v in ref_out.items()), cp
            assert all(torch.equal(raw[k], v) for k, v in ref_raw.items()), cp


@pytest.mark.parametrize("quant", ["none", "qat"])
def test_cp_gathers_carry_the_stored_swa_rows(quant: str) -> None:
    """Bytes per token per layer that the SWA gather carries: the stored row (qat: D + D/32
    bytes; none: D values of the cache dtype), each rank having keyed its own rows; CP = 2
    equals CP = 1 (none: 1e-5 as in tests/cp)."""
    from dsv4cp.cp.fake import FakeCPGroup, FakeCPWorld, run_ranks

    model = MODELS[quant]
    tokens = _prompt(41, 9)
    sizes: dict[str, int] = {}
    real = FakeCPGroup.all_gather

    def recording(self, x: Tensor, *, tag: str) -> Tensor:  # noqa: ANN001
        if self.rank == 0:
            sizes[tag] = x[0].numel() * x.element_size()
        return real(self, x, tag=tag)

    def body(group):  # noqa: ANN001, ANN202
        cache = KVCache(model.config, 512, quant=quant, window_slots=128, max_context=64)  # type: ignore[arg-type]
        return PrefillRunner(model, cache=cache, cp=group).prefill(
            {"a": tokens}, return_all_logits=True
        )

    mp = pytest.MonkeyPatch()
    with mp.context() as m:
        m.setattr(FakeCPGroup, "all_gather", recording)
        outs = run_ranks(FakeCPWorld(2, timeout_s=60), body)
    d = model.config.head_dim
    want = d + d // 32 if quant == "qat" else d * 4
    assert {k: v for k, v in sizes.items() if k.endswith("/swa_rows")} == {
        f"layer{i}/swa_rows": want for i in range(model.config.num_hidden_layers)
    }
    one = _chunked(_runner(model, quant), tokens, [len(tokens)])
    # qat: a code can flip where a GEMM of other row counts rounds differently (≈1e-3)
    tol = TOL if quant == "none" else 1e-2
    for out in outs:
        assert out.all_logits is not None and _rel(out.all_logits, one) <= tol
        assert torch.equal(out.all_logits, outs[0].all_logits)  # every rank: the same rows
