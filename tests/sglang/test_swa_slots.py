"""dsv4cp's SWA rows on SGLang's hybrid-SWA slots, without sglang (docs/sglang.md, *Caches*).

A stand-in of SGLang's `SWATokenToKVPoolAllocator`: full slots and SWA slots from separate free
lists (SWA slots, or at page size P > 1 SWA pages, shuffled, so that they never equal the full
slots; at P > 1 both sides page-aligned, slot ≡ position mod P, as SGLang's paged allocators
hand them out), its `full_to_swa_index_mapping` updated in place (0: no SWA slot), and the SWA
slots of a request's positions older than the window handed back after each forward, as SGLang's
`free_swa_out_of_window_slots` does (it keeps the last W positions; whole pages at P > 1).
`ServingEngine` on that mapping must give bit-identical hidden rows to the engine with a row per
token slot, through chunked prefill with odd chunk starts (the ratio-2 pair state: a row per SWA
slot at P = 1, per even SWA slot at P = 4), decode, a second request sharing the first one's
prefix (a radix hit) and freed slots reused by other tokens; a broken pair read must show.
"""

from __future__ import annotations

import importlib.util
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
    """SGLang's side: `req_to_token` rows of int32 full slots, and the full → SWA slot map.
    Page size 1: slots one by one; P > 1: a request's position p at offset p mod P of its
    pages (full pages in order from 1, SWA pages from a shuffled free list)."""

    page: int = 1
    req_to_token: torch.Tensor = field(
        default_factory=lambda: torch.zeros(ROWS, CONTEXT, dtype=torch.int32)
    )
    mapping: torch.Tensor = field(default_factory=lambda: torch.zeros(FULL + 8, dtype=torch.long))
    lens: dict[int, int] = field(default_factory=dict)
    swa_from: dict[int, int] = field(default_factory=dict)  # first position still holding SWA
    next_full: int = 1
    evictions: int = 0  # evict_window calls that handed slots back

    def __post_init__(self) -> None:
        p = self.page
        self.free_swa = list(range(1, SWA_SLOTS // p + 1))  # SWA slots, or pages at P > 1
        random.Random(0).shuffle(self.free_swa)
        if p > 1:
            self.next_full = p  # page 0 holds the dummy slot

    @property
    def num_slots(self) -> int:
        return FULL + 2 * self.page

    def swa_pool(self) -> SWAPool:
        return SWAPool(SWA_SLOTS + 2 * self.page, self.mapping)

    def extend(self, row: int, n: int) -> tuple[int, torch.Tensor]:
        start = self.lens.get(row, 0)
        p = self.page
        if p == 1:
            full = torch.arange(self.next_full, self.next_full + n)
            self.next_full += n
            swa = torch.tensor([self.free_swa.pop() for _ in range(n)])
        else:
            fulls, swas = [], []
            for pos in range(start, start + n):
                if pos % p and pos > start:  # the page this call opened or continued
                    fulls.append(fulls[-1] + 1)
                    swas.append(swas[-1] + 1)
                elif pos % p:  # continue the page of position pos - 1
                    last = int(self.req_to_token[row, pos - 1])
                    fulls.append(last + 1)
                    swas.append(int(self.mapping[last]) + 1)
                else:
                    fulls.append(self.next_full)
                    self.next_full += p
                    swas.append(self.free_swa.pop() * p)
            full, swa = torch.tensor(fulls), torch.tensor(swas)
        assert int(full.max()) < self.num_slots
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
        """Hand back the SWA slots of positions < len − W (the last W positions stay; at P > 1
        the whole pages below it)."""
        p = self.page
        lo, hi = self.swa_from.get(row, 0), (self.lens[row] - W) // p * p
        if hi <= lo:
            return
        full = self.req_to_token[row, lo:hi].long()
        self.free_swa += (self.mapping[full[::p]] // p).tolist()
        self.mapping[full] = 0
        self.swa_from[row] = hi
        self.evictions += 1


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


def _run_steps(
    model: DeepseekV41Model, alloc: StandInHybridAllocator, hybrid: ServingEngine
) -> tuple[ServingEngine, list[bool]]:
    """STEPS on `hybrid` (SWA rows on the allocator's SWA slots) and on an engine with a row
    per token slot: whether each forward's hidden rows are equal; windows evicted after each."""
    every = ServingEngine(model)
    equal = []
    for i, new in enumerate(STEPS):
        batch = _batch(alloc, new, seed=i, vocab=model.config.vocab_size)
        equal.append(_forward_both(hybrid, every, alloc, batch))
        for row in batch.req_rows:
            alloc.evict_window(row)
    return every, equal


def _forward_both(
    hybrid: ServingEngine, every: ServingEngine, alloc: StandInHybridAllocator, batch: SGLangBatch
) -> bool:
    """One forward on both engines: whether the hidden rows are bit-identical."""
    cp, n, p = SingleCPGroup(), alloc.num_slots, alloc.page
    got = hybrid.forward(batch, alloc.req_to_token, cp, num_slots=n, page=p, swa=alloc.swa_pool())
    return torch.equal(got, every.forward(batch, alloc.req_to_token, cp, num_slots=n, page=p))


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("quant", ["none", "qat"])
def test_hidden_rows_on_swa_slots_equal_a_row_per_slot(quant: str, page: int) -> None:
    model = _model(quant)
    assert model.config.sliding_window == W
    vocab = model.config.vocab_size
    hybrid = ServingEngine(model)
    alloc = StandInHybridAllocator(page=page)
    every, equal = _run_steps(model, alloc, hybrid)
    assert all(equal)
    cache, ref = hybrid.cache, every.cache
    rows = SWA_SLOTS + 2 * page
    assert cache is not None and ref is not None and cache.swa_slots == rows
    assert cache.swa[0].shape[0] == rows and alloc.evictions >= 2
    # a row per even SWA slot at an even page size, else one per SWA slot
    assert cache.pair_div == (2 if page % 2 == 0 else 1)
    assert all(t.shape[0] == -(-rows // cache.pair_div) for t in cache.pair_kv.values())
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
    # a radix hit on request 0's sequence: at page 1 all of it (odd length: its partner is in
    # the pair state); at page 4 its whole pages (SGLang's paged radix cache matches no more)
    assert length % 2 == 1
    hit = length // page * page
    alloc.share(0, 2, hit)
    assert _forward_both(hybrid, every, alloc, _batch(alloc, {2: 12}, seed=99, vocab=vocab))


def test_a_broken_pair_read_changes_the_hidden_rows() -> None:
    """The comparison above can fail: the same steps at page size 4 with the pair state read
    from the dummy row (the partner lost) differ at the forwards starting at odd positions."""
    model = DeepseekV41Model(TINY, seed=3)
    hybrid = ServingEngine(model)
    alloc = StandInHybridAllocator(page=4)
    hybrid.cache_for(alloc.num_slots, 4, alloc.req_to_token, alloc.swa_pool())
    cache = hybrid.cache
    assert cache is not None and cache.pair_div == 2
    read = cache.pair_read_rows
    # the partner lost: the rows that read the pair state read the dummy row 0 instead
    cache.pair_read_rows = lambda tok: read(tok).clamp(max=0)  # type: ignore[method-assign]
    _, equal = _run_steps(model, alloc, hybrid)
    # STEPS 0 and 1 start at even positions (0, 40, 0); 2 at odd ones (65, 9)
    assert equal[:2] == [True, True] and not equal[2]


def test_an_even_position_on_an_odd_swa_slot_is_an_error() -> None:
    """At an even page size the pair state has a row per even SWA slot: an even position
    written on, or read from, an odd SWA slot (never from SGLang's paged allocator) raises."""
    model = DeepseekV41Model(TINY, seed=3)

    def forward(engine: ServingEngine, alloc: StandInHybridAllocator, batch: SGLangBatch) -> None:
        cp, n = SingleCPGroup(), alloc.num_slots
        engine.forward(batch, alloc.req_to_token, cp, num_slots=n, page=4, swa=alloc.swa_pool())

    # a write: position 8 opens a page whose SWA slot is moved one up
    engine, alloc = ServingEngine(model), StandInHybridAllocator(page=4)
    forward(engine, alloc, _batch(alloc, {0: 7}, 0))
    batch = _batch(alloc, {0: 2}, 1)
    alloc.mapping[alloc.req_to_token[0, 8].long()] += 1
    with pytest.raises(RuntimeError, match="even position 8 has the odd SWA slot"):
        forward(engine, alloc, batch)
    # a read: position 7 reads its partner 6, whose SWA slot was moved one up
    engine, alloc = ServingEngine(model), StandInHybridAllocator(page=4)
    forward(engine, alloc, _batch(alloc, {0: 6}, 0))
    batch = _batch(alloc, {0: 1}, 2)
    forward(engine, alloc, batch)  # position 6 on its even slot passes
    alloc.mapping[alloc.req_to_token[0, 6].long()] += 1
    with pytest.raises(RuntimeError, match="even position 6 has the odd SWA slot"):
        forward(engine, alloc, _batch(alloc, {0: 1}, 3))


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


@pytest.mark.parametrize("page", [1, 256])
@pytest.mark.parametrize("ratio", [0.05, 0.1, 0.8])
def test_cache_bytes_of_swa_slots_equal_the_allocation(ratio: float, page: int) -> None:
    """Flash dims on the meta device: a cache of N token slots and ⌊R·N⌋ SWA slots (plus the
    dummy row at page 1, the dummy page at page 256) is what `cache_bytes(...,
    swa_full_ratio=R)` plans: the pair state a row per SWA slot at page 1, per even SWA slot
    at page 256."""
    flash = DeepseekV41Config.flash()
    n = 128 * 1024
    plan = cache_bytes(flash, n, page_size=page, swa_full_ratio=ratio)
    swa = int(n * ratio) // page * page
    cache = KVCache(
        flash,
        n + page,
        quant="qat",
        swa_slots=swa + page,
        max_requests=1,
        max_context=n,
        page_size=page,
        device="meta",
        dtype=torch.bfloat16,
    )
    alloc = cache.nbytes_by_kind()
    div = 1 if page == 1 else 2
    assert cache.pair_div == div
    assert plan.rows["swa_window"] == 40 * swa and plan.rows["pair_state"] == 3 * 2 * swa // div
    assert alloc["swa_window"] - plan.by_kind["swa_window"] == 40 * 528 * page  # the dummy page
    dummy_pair_rows = 1 if page == 1 else page // 2
    assert alloc["pair_state"] - plan.by_kind["pair_state"] == 3 * 2 * 512 * 4 * dummy_pair_rows
    every = cache_bytes(flash, n, page_size=page, windowed=False)
    assert plan.by_kind["compressed"] == every.by_kind["compressed"]
    # swa of n slots per layer and ratio-2 source, pair rows halved at page 256
    assert plan.by_kind["swa_window"] * n == every.by_kind["swa_window"] * swa
    assert plan.by_kind["pair_state"] * n * div == every.by_kind["pair_state"] * swa
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


def test_a_swa_pool_below_a_window_and_a_chunk_is_warned_about() -> None:
    from dsv4cp.integrations.sglang.model import small_swa_pool

    said = small_swa_pool(32, 16, 64, 320, 0.1)  # the measured case: W 16, chunk 64
    assert said is not None
    assert "holds ~32 slots" in said and "(16 + 64 = 80)" in said
    assert "--swa-full-tokens-ratio >= 0.25" in said
    assert small_swa_pool(80, 16, 64, 320, 0.25) is None
    assert small_swa_pool(102, 16, 64, 1024, 0.1) is None
    # Flash: 16K chunks over a 128K pool at the default 0.1 are shrunk; over a 1M pool they fit
    assert small_swa_pool(13107, 128, 16384, 131072, 0.1) is not None
    assert small_swa_pool(104857, 128, 16384, 1048576, 0.1) is None
    assert small_swa_pool(10, 16, None, 100, 0.1) is None  # nothing known to compare with


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
    monkeypatch.setenv(WINDOW_CHECK_ENV, "2")
    with pytest.raises(ValueError, match=WINDOW_CHECK_ENV):
        window_check_enabled(cpu)


@pytest.mark.sglang
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed")
@pytest.mark.parametrize("page", [2, 16, 256])
def test_sglang_paged_swa_allocator_keeps_the_position_parity(page: int) -> None:
    """What `KVCache.pair_div` 2 relies on, on SGLang's own `SWATokenToKVPoolAllocator` (CPU,
    its torch path): random requests extended and decoded, the SWA pages behind each window
    freed (whole pages, as `free_swa_out_of_window_slots`), finished requests freed; every held
    SWA slot ≡ its position mod the page size (so an even position's SWA slot is even)."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool

    class Pool(BaseSWAKVPool):  # what the allocator reads of SGLang's SWAKVPool
        swa_req_ring_size = None
        full_kv_pool = swa_kv_pool = None

        def register_mapping(self, mapping: torch.Tensor) -> None:
            self.full_to_swa_index_mapping = mapping

        def translate_loc_from_full_to_swa(self, locs: torch.Tensor) -> torch.Tensor:
            return self.full_to_swa_index_mapping[locs]

    Pool.__abstractmethods__ = frozenset()
    alloc = SWATokenToKVPoolAllocator(
        64 * page, 24 * page, page, torch.int64, "cpu", object.__new__(Pool), need_sort=False
    )
    mapping, rng, window = alloc.full_to_swa_index_mapping, random.Random(page), page + page // 2
    reqs: dict[int, list[int]] = {}
    held = refused = 0

    def t(v: list[int]) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.int64)

    for _ in range(300):
        locs = reqs.setdefault(rng.randrange(6), [])
        pre, n = len(locs), rng.choice([1, 1, rng.randrange(1, 3 * page)])
        last = t([locs[-1] if locs else -1])
        if n == 1 and pre:
            out = alloc.alloc_decode(t([pre + 1]), t([pre + 1]), last)
        else:
            out = alloc.alloc_extend(t([pre]), t([pre]), t([pre + n]), t([pre + n]), last, n)
        if out is None:  # pool full: the request finishes
            full = t(locs)
            alloc.free_swa(full[mapping[full] > 0])
            alloc.free_full(full)
            locs.clear()
            refused += 1
            continue
        locs += out.tolist()
        old = t(locs[: max(0, (len(locs) - window) // page * page)])
        if old.numel() and bool((mapping[old] > 0).any()):
            alloc.free_swa(old[mapping[old] > 0])
        swa = mapping[t(locs)]
        pos = torch.arange(len(locs))
        assert bool(((swa == 0) | (swa % page == pos % page)).all())
        held += int((swa > 0).sum())
    assert held > 500 and refused > 0  # pools filled: freed pages were handed out again


def test_a_cache_built_for_another_page_size_is_reallocated() -> None:
    """The page size fixes the cache's layout (compressed rows slot // r, the pair rows'
    halving): a cache preallocated at page 16 and then handed SGLang's page-1 pools is rebuilt,
    so the forwards equal a fresh engine's (they differed by up to 1.46 when it was reused)."""
    model = DeepseekV41Model(TINY, seed=3)
    n = 512
    slots = list(range(1, n))
    random.Random(0).shuffle(slots)  # page 1: slots in any order

    def run(engine: ServingEngine) -> list[torch.Tensor]:
        r2t = torch.zeros(4, 256, dtype=torch.int32)
        outs, start = [], 0
        for length in (40, 25, 1):
            s = torch.tensor(slots[start : start + length])
            r2t[0, start : start + length] = s.int()
            g = torch.Generator().manual_seed(start)
            ids = torch.randint(0, TINY.vocab_size, (length,), generator=g)
            batch = SGLangBatch("extend", (0,), (start,), (length,), ids, s)
            outs.append(engine.forward(batch, r2t, SingleCPGroup(), num_slots=n + 2, page=1))
            start += length
        return outs

    with torch.no_grad():
        want = run(ServingEngine(model))
        engine = ServingEngine(model)
        engine.cache = engine.new_cache(n + 32, 16, (1, 1))
        got = run(engine)
    assert engine.cache is not None and engine.cache.page_size == 1
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
