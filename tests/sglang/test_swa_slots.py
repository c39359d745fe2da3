"""dsv4cp's SWA rows on SGLang's hybrid-SWA slots, without sglang (docs/sglang.md, *Caches*).

A stand-in of SGLang's `SWATokenToKVPoolAllocator` (page size 1): full slots and SWA slots from
separate free lists (SWA slots shuffled, so that they never equal the full slots), its
`full_to_swa_index_mapping` updated in place (0: no SWA slot), and the SWA slots of a request's
positions older than the window handed back after each forward, as SGLang's
`free_swa_out_of_window_slots` does (it keeps the last W positions). `ServingEngine` on that
mapping must give bit-identical hidden rows to the engine with a row per token slot, through
chunked prefill with odd chunk starts (the ratio-2 pair state), decode, a second request sharing
the first one's prefix (a radix hit), and freed slots reused by other tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from dsv4cp.cache import KVCache, cache_bytes
from dsv4cp.config import DeepseekV41Config
from dsv4cp.cp.group import SingleCPGroup
from dsv4cp.integrations.sglang.engine import (
    WINDOW_CHECK_ENV,
    ServingEngine,
    SWAPool,
    check_window_held,
    window_check_enabled,
)
from dsv4cp.integrations.sglang.forward_batch import SGLangBatch, sync_req_to_token
from dsv4cp.model import DeepseekV41Model

TINY = DeepseekV41Config.tiny()
W = TINY.sliding_window
CKPT = Path(__file__).resolve().parents[1] / "fixtures" / "dsv41-tiny-reference" / "checkpoint"
FULL, SWA_SLOTS, ROWS, CONTEXT = 512, 160, 4, 256


@dataclass
class StandInHybridAllocator:
    """SGLang's side: `req_to_token` rows of int32 full slots, and the full → SWA slot map."""

    req_to_token: torch.Tensor = field(
        default_factory=lambda: torch.zeros(ROWS, CONTEXT, dtype=torch.int32)
    )
    mapping: torch.Tensor = field(default_factory=lambda: torch.zeros(FULL + 2, dtype=torch.long))
    lens: dict[int, int] = field(default_factory=dict)
    swa_from: dict[int, int] = field(default_factory=dict)  # first position still holding SWA
    next_full: int = 1

    def __post_init__(self) -> None:
        self.free_swa = list(range(1, SWA_SLOTS + 1))
        random.Random(0).shuffle(self.free_swa)

    def extend(self, row: int, n: int) -> tuple[int, torch.Tensor]:
        start = self.lens.get(row, 0)
        full = torch.arange(self.next_full, self.next_full + n)
        self.next_full += n
        swa = torch.tensor([self.free_swa.pop() for _ in range(n)])
        self.mapping[full] = swa
        self.req_to_token[row, start : start + n] = full.int()
        self.lens[row] = start + n
        return start, full

    def share(self, src: int, dst: int, length: int) -> None:
        """`dst` starts with `src`'s first `length` positions (a radix-cache hit)."""
        self.req_to_token[dst, :length] = self.req_to_token[src, :length]
        self.lens[dst] = length
        self.swa_from[dst] = self.swa_from.get(src, 0)

    def evict_window(self, row: int) -> None:
        """Hand back the SWA slots of positions < len − W (the last W positions stay)."""
        lo, hi = self.swa_from.get(row, 0), self.lens[row] - W
        if hi <= lo:
            return
        full = self.req_to_token[row, lo:hi].long()
        self.free_swa += self.mapping[full].tolist()
        self.mapping[full] = 0
        self.swa_from[row] = hi


def _batch(
    alloc: StandInHybridAllocator, new: dict[int, int], seed: int, vocab: int = TINY.vocab_size
) -> SGLangBatch:
    g = torch.Generator().manual_seed(seed)
    rows, starts, lens, slots = [], [], [], []
    for row, n in new.items():
        start, full = alloc.extend(row, n)
        rows.append(row)
        starts.append(start)
        lens.append(n)
        slots.append(full)
    ids = torch.randint(0, vocab, (sum(lens),), generator=g)
    mode = "decode" if all(n == 1 for n in lens) and all(starts) else "extend"
    return SGLangBatch(mode, tuple(rows), tuple(starts), tuple(lens), ids, torch.cat(slots))


# (request rows and their new tokens) per forward: chunks of 40 then 25 (the second and third
# start at odd positions 65 and 1 + ...), a second request, decode of both.
STEPS: list[dict[int, int]] = [{0: 40}, {0: 25, 1: 9}, {0: 1, 1: 1}, {0: 1, 1: 1}, {0: 24}]


def _model(quant: str) -> DeepseekV41Model:
    """`none`: the tiny random dense model; `qat`: the released-format fixture (quantized
    caches: fp8 SWA rows; Engram, MoE, hyper-connections)."""
    if quant == "none":
        return DeepseekV41Model(TINY, seed=3)
    if not (CKPT / "config.json").is_file():
        pytest.skip(f"fixture checkpoint missing: {CKPT}")
    return DeepseekV41Model.from_checkpoint(CKPT, quant="qat", dtype=torch.float32)


@pytest.mark.parametrize("quant", ["none", "qat"])
def test_hidden_rows_on_swa_slots_equal_a_row_per_slot(quant: str) -> None:
    model = _model(quant)
    assert model.config.sliding_window == W
    vocab = model.config.vocab_size
    hybrid, every = ServingEngine(model), ServingEngine(model)
    alloc = StandInHybridAllocator()
    cp = SingleCPGroup()
    reused = 0

    def run(batch: SGLangBatch) -> None:
        nonlocal reused
        swa = SWAPool(SWA_SLOTS + 2, alloc.mapping)
        got = hybrid.forward(batch, alloc.req_to_token, cp, num_slots=FULL + 2, page=1, swa=swa)
        want = every.forward(batch, alloc.req_to_token, cp, num_slots=FULL + 2, page=1)
        assert torch.equal(got, want)
        for row in batch.req_rows:
            before = len(alloc.free_swa)
            alloc.evict_window(row)
            reused += len(alloc.free_swa) > before

    for i, new in enumerate(STEPS):
        run(_batch(alloc, new, seed=i, vocab=vocab))
    cache, ref = hybrid.cache, every.cache
    assert cache is not None and ref is not None and cache.swa_slots == SWA_SLOTS + 2
    assert cache.swa[0].shape[0] == SWA_SLOTS + 2 and reused >= 2
    # the rows request 0 still holds equal the every-slot cache's rows of the same slots (the
    # pair state at even positions: only those are written)
    length = alloc.lens[0]
    pos = torch.arange(alloc.swa_from[0], length)
    held = alloc.req_to_token[0, pos].long()
    a, b = cache.slot_view(held), ref.slot_view(held)
    even = pos % 2 == 0
    for k in a:
        if k.startswith("swa."):
            assert torch.equal(a[k], b[k]), k
        if k.startswith("pair_"):
            assert torch.equal(a[k][even], b[k][even]), k
    # a radix hit on request 0's whole sequence (odd length: its partner is in the pair state)
    assert length % 2 == 1
    alloc.share(0, 2, length)
    run(_batch(alloc, {2: 12}, seed=99, vocab=vocab))


def test_a_window_read_of_a_freed_slot_is_an_error() -> None:
    model = DeepseekV41Model(TINY, seed=3)
    engine = ServingEngine(model)
    alloc = StandInHybridAllocator()
    cp = SingleCPGroup()
    swa = SWAPool(SWA_SLOTS + 2, alloc.mapping)
    engine.forward(
        _batch(alloc, {0: 60}, 0), alloc.req_to_token, cp, num_slots=FULL + 2, page=1, swa=swa
    )
    alloc.evict_window(0)  # positions 0..43 freed
    alloc.share(0, 1, 40)  # a prefix whose window (positions 25..39) was freed
    with pytest.raises(RuntimeError, match="position 25 in its window"):
        engine.forward(
            _batch(alloc, {1: 5}, 1), alloc.req_to_token, cp, num_slots=FULL + 2, page=1, swa=swa
        )
    # the same prefix end with its window held passes the check
    alloc.share(0, 3, 60)
    cache = engine.cache
    assert cache is not None
    batch = _batch(alloc, {3: 3}, 2)
    sync_req_to_token(cache.req_to_token, alloc.req_to_token, batch)
    check_window_held(cache, batch, W)


def test_swa_rows_follow_the_map() -> None:
    cache = KVCache(TINY, 32, swa_slots=8, page_size=1)
    assert cache.swa[0].shape[0] == 8 and cache.pair_kv[1].shape[0] == 8
    slots = torch.tensor([-1, 0, 1, 2, 3])
    assert cache.swa_rows(slots).tolist() == [-1, 0, -1, -1, -1]  # nothing held yet
    mapping = torch.zeros(34, dtype=torch.long)
    mapping[torch.tensor([1, 2, 3])] = torch.tensor([5, 7, 1])
    cache.set_swa_slot_map(mapping)
    assert cache.swa_rows(slots).tolist() == [-1, 0, 5, 7, 1]
    mapping[2] = 0  # SGLang frees slot 2's SWA slot in place: the cache sees it
    assert cache.swa_rows(slots).tolist() == [-1, 0, 5, -1, 1]
    with pytest.raises(ValueError, match="1-d map"):
        cache.set_swa_slot_map(mapping[:1])
    with pytest.raises(ValueError, match="built without swa_slots"):
        KVCache(TINY, 32).set_swa_slot_map(mapping)
    with pytest.raises(ValueError, match="excludes window_slots"):
        KVCache(TINY, 32, swa_slots=8, window_slots=8)


@pytest.mark.parametrize("ratio", [0.05, 0.1, 0.8])
def test_cache_bytes_of_swa_slots_equal_the_allocation(ratio: float) -> None:
    """Flash dims on the meta device: a cache of N token slots and ⌊R·N⌋ SWA slots (plus the
    dummy row) is what `cache_bytes(..., swa_full_ratio=R)` plans."""
    flash = DeepseekV41Config.flash()
    n, page = 128 * 1024, 1
    plan = cache_bytes(flash, n, page_size=page, swa_full_ratio=ratio)
    swa = int(n * ratio)
    cache = KVCache(
        flash,
        n + 1,
        quant="qat",
        swa_slots=swa + 1,
        max_requests=1,
        max_context=n,
        page_size=page,
        device="meta",
        dtype=torch.bfloat16,
    )
    alloc = cache.nbytes_by_kind()
    assert plan.rows["swa_window"] == 40 * swa and plan.rows["pair_state"] == 3 * 2 * swa
    assert alloc["swa_window"] - plan.by_kind["swa_window"] == 40 * 528  # the dummy row
    assert alloc["pair_state"] - plan.by_kind["pair_state"] == 3 * 2 * 512 * 4
    every = cache_bytes(flash, n, page_size=page, windowed=False)
    assert plan.by_kind["compressed"] == every.by_kind["compressed"]
    assert plan.by_kind["swa_window"] == pytest.approx(ratio * every.by_kind["swa_window"], 1e-4)
    with pytest.raises(ValueError, match="swa_full_ratio"):
        cache_bytes(flash, n, swa_full_ratio=0.0)


def test_sglang_pools_and_planned_rows() -> None:
    """What the model class reads of SGLang's pools (`swa_pool_of`), and the SWA rows it
    preallocates before SGLang builds them (`swa_rows_planned`, SGLang's
    `HybridSWAPoolConfigurator` arithmetic; the released-fixture servers log the same)."""
    from types import SimpleNamespace

    from dsv4cp.integrations.sglang.model import swa_pool_of, swa_rows_planned

    mapping = torch.zeros(4098, dtype=torch.long)
    pool = swa_pool_of(SimpleNamespace(full_to_swa_index_mapping=mapping, size_swa=409))
    assert pool is not None and pool.rows == 411 and pool.mapping is mapping
    paged = SimpleNamespace(full_to_swa_index_mapping=mapping, size_swa=256, page_size=256)
    assert swa_pool_of(paged) == SWAPool(768, mapping)
    assert swa_pool_of(SimpleNamespace(size=4096)) is None  # --disable-hybrid-swa-memory
    assert swa_rows_planned(4096, 1, 0.1) == 411 and swa_rows_planned(4096, 1, 0.05) == 206
    assert swa_rows_planned(4096, 256, 0.1) == 256 + 512


def test_window_check_runs_on_cpu_by_default_and_follows_the_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(WINDOW_CHECK_ENV, raising=False)
    assert window_check_enabled(cpu) and not window_check_enabled(cuda)
    monkeypatch.setenv(WINDOW_CHECK_ENV, "1")
    assert window_check_enabled(cpu) and window_check_enabled(cuda)
    monkeypatch.setenv(WINDOW_CHECK_ENV, "0")
    assert not window_check_enabled(cpu) and not window_check_enabled(cuda)
    monkeypatch.setenv(WINDOW_CHECK_ENV, "yes")
    with pytest.raises(ValueError, match=WINDOW_CHECK_ENV):
        window_check_enabled(cpu)
