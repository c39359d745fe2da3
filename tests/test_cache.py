"""KVCache geometry and the allocator's window, and `cache_bytes` against real allocations.

The Flash numbers are measured by allocating the caches at Flash dims on the meta device.
"""

from __future__ import annotations

import pytest
import torch

from dsv4cp.batch import PrefillBatch, RequestSlice, build_metadata
from dsv4cp.cache import (
    CacheFullError,
    KVCache,
    PagedAllocator,
    cache_bytes,
    swa_window_rows,
)
from dsv4cp.config import DeepseekV41Config

FLASH = DeepseekV41Config.flash()
TINY = DeepseekV41Config.tiny()
KINDS = ("swa_window", "compressed", "index_keys", "pair_state", "slot_tables")


def _flash_cache_for(tokens: int, page: int, *, quant: str = "qat") -> KVCache:
    """A meta-device cache holding exactly one request of `tokens` (plus the dummy page)."""
    pages = -(-tokens // page)
    return KVCache(
        FLASH,
        (pages + 1) * page,
        quant=quant,  # type: ignore[arg-type]
        window_slots=swa_window_rows(tokens, FLASH.sliding_window, page),
        max_requests=1,
        max_context=tokens,
        page_size=page,
        device="meta",
        dtype=torch.bfloat16,
    )


@pytest.mark.parametrize("page", [16, 64, 256])
def test_flash_128k_request_fits_950_bytes_per_token(page: int) -> None:
    n = 128 * 1024
    plan = cache_bytes(FLASH, n, page_size=page)
    alloc = _flash_cache_for(n, page).nbytes_by_kind()
    # The allocation is the plan plus the dummy page (slot 0) and the dummy pair row, exactly.
    dummy = {
        "swa_window": 40 * page * 528,  # one page per layer's window pool
        "compressed": (3 * page // 2 + page) * 288,  # kv sources 2, 8, 14 (r2) and 20 (r1)
        "index_keys": (3 * page // 2 + page) * 68,
        "pair_state": 3 * 2 * 512 * 4,  # one dummy row of kv and gate per ratio-2 source
        "slot_tables": 4 + page * 4,  # the dummy page's SWA page-table entry and token ids
    }
    assert {k: alloc[k] - plan.by_kind[k] for k in KINDS} == dummy
    # 2.5 entries per token: 720 B compressed + 170 B index keys, the window ~20.6 B
    assert plan.by_kind["compressed"] == n * 720 and plan.by_kind["index_keys"] == n * 170
    assert plan.by_kind["swa_window"] == 40 * swa_window_rows(n, 128, page) * 528
    assert plan.per_token <= 950, plan.by_kind
    # measured: the whole allocation, dummy page included (a fixed 41 B/token at page 256)
    measured = sum(alloc.values()) / n
    assert measured <= (950 if page <= 64 else 990), alloc


def test_flash_without_window_or_quantization_costs_what_the_issue_measured() -> None:
    n = 128 * 1024
    dense = cache_bytes(FLASH, n, quant="none", windowed=False, dtype=torch.bfloat16)
    # bf16 SWA row per layer and slot, bf16 compressed and index keys, fp32 pair state per slot
    assert 55 * 1024 < dense.per_token < 60 * 1024
    assert cache_bytes(FLASH, n, windowed=False).by_kind["swa_window"] == 40 * n * 528


def test_cache_bytes_small_cases_and_errors() -> None:
    assert swa_window_rows(0, 128, 16) == 0
    assert swa_window_rows(5, 128, 16) == 16  # everything is in the window
    assert swa_window_rows(127, 128, 1) == 127
    assert swa_window_rows(1000, 128, 1) == 127  # positions 873..999: the next token reads them
    assert swa_window_rows(1000, 128, 16) == 63 * 16 - 54 * 16  # pages 54..62
    zero = cache_bytes(FLASH, 0)
    assert zero.total == 0
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        cache_bytes(FLASH, -1)
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        cache_bytes(FLASH, 5, page_size=0)


def test_page_size_not_a_multiple_of_the_ratio_keeps_a_row_per_slot() -> None:
    odd = cache_bytes(FLASH, 1024, page_size=1)
    even = cache_bytes(FLASH, 1024, page_size=2)
    assert odd.rows["compressed"] == 4 * 1024 and even.rows["compressed"] == 1024 * 5 // 2


def _meta(batch: PrefillBatch, cache: KVCache, slots: list[int]):  # noqa: ANN202
    return build_metadata(batch, cache.req_to_token, slots, [1, 2]).tokens


def test_entry_rows_are_compact_and_distinct() -> None:
    cache = KVCache(TINY, 256, page_size=4, max_context=200, max_requests=4)
    alloc = PagedAllocator(cache)
    rows = {}
    for rid, n in (("a", 37), ("b", 50), ("c", 9)):
        res = alloc.reserve(rid, n)
        alloc.write_table(res)
        alloc.commit(res)
        rows[rid] = res
    for r in (1, 2):
        seen: set[int] = set()
        for res in rows.values():
            last = [s for p, s in enumerate(res.slots) if (p + 1) % r == 0]
            got = cache.entry_rows(r, torch.tensor(last)).tolist()
            assert len(set(got)) == len(got) and not seen & set(got)
            assert max(got) < cache.compressed[1 if r == 2 else 3].shape[0]
            seen |= set(got)
    assert cache.compressed[1].shape[0] == 128 and cache.compressed[3].shape[0] == 256


def test_window_pages_are_freed_once_older_than_the_window() -> None:
    w, page = TINY.sliding_window, 4
    cache = KVCache(TINY, 256, window_slots=64, page_size=page, max_context=200, max_requests=4)
    alloc = PagedAllocator(cache)
    free0 = len(alloc.free_swa_pages)
    assert free0 == 16  # 64 rows in pages of 4, plus the dummy page
    for n in (10, 3, 1, 1, 30):
        res = alloc.reserve("a", n)
        alloc.write_table(res)
        alloc.commit(res)
        st = alloc.requests["a"]
        need_from = st.length - w + 1
        for i, page_id in enumerate(st.pages):
            held = int(cache.swa_page_table[page_id]) >= 0
            assert held == ((i + 1) * page > need_from), (st.length, i)
        assert alloc.swa_pages_held("a") * page == swa_window_rows(st.length, w, page)
    alloc.free("a")
    assert len(alloc.free_swa_pages) == free0
    assert int((cache.swa_page_table[1:] >= 0).sum()) == 0


def test_window_pool_too_small_is_a_cache_full_error_that_changes_nothing() -> None:
    # the window (16) and a chunk of 4 need at most 6 pages of 4 rows
    cache = KVCache(TINY, 256, window_slots=24, page_size=4, max_context=200, max_requests=4)
    alloc = PagedAllocator(cache)
    before = (list(alloc.free_pages), list(alloc.free_swa_pages))
    with pytest.raises(CacheFullError, match="SWA window pages"):
        alloc.reserve("a", 40)  # one chunk of 40 needs 10 window pages at once
    assert (alloc.free_pages, alloc.free_swa_pages) == before
    for _ in range(10):  # the same tokens in chunks of 4 fit: pages are recycled
        res = alloc.reserve("a", 4)
        alloc.write_table(res)
        alloc.commit(res)


def test_rollback_restores_the_pending_pair_row_and_the_window() -> None:
    cache = KVCache(TINY, 256, window_slots=64, page_size=4, max_context=200, max_requests=4)
    alloc = PagedAllocator(cache)
    res = alloc.reserve("a", 9)
    alloc.write_table(res)
    alloc.commit(res)
    row = alloc.requests["a"].row
    cache.pair_kv[1][row] = 7.0
    table = cache.swa_page_table.clone()
    free = list(alloc.free_swa_pages)
    res = alloc.reserve("a", 6)
    alloc.write_table(res)
    cache.pair_kv[1][row] = -1.0  # the failed forward overwrote the pending row
    alloc.rollback(res)
    assert torch.all(cache.pair_kv[1][row] == 7.0)
    assert torch.equal(cache.swa_page_table, table) and alloc.free_swa_pages == free


def test_pair_rows_windowed_and_per_slot() -> None:
    batch = PrefillBatch(
        (RequestSlice("a", 2, 5, tuple(range(4))), RequestSlice("b", 0, 0, tuple(range(3))))
    )
    for windowed in (True, False):
        cache = KVCache(
            TINY, 64, window_slots=32 if windowed else None, page_size=1, max_requests=4
        )
        cache.req_to_token[2, :9] = torch.arange(10, 19)
        cache.req_to_token[0, :3] = torch.arange(30, 33)
        tok = _meta(batch, cache, [15, 16, 17, 18, 30, 31, 32])
        read, write = cache.pair_read_rows(tok).tolist(), cache.pair_write_rows(tok).tolist()
        if windowed:  # a: starts at 5 (odd) → its row; ends at 9 (odd): position 8 writes
            assert read == [2, -1, -1, -1, -1, -1, -1] and write == [-1, -1, -1, 2, -1, -1, 0]
        else:  # the partner's slot; every even token writes its slot; −1: none
            assert read == [14, -1, -1, -1, -1, -1, -1] and write == [-1, 16, -1, 18, 30, -1, 32]


@pytest.mark.parametrize("page", [1, 2])
def test_pair_rows_on_swa_slots_halve_at_an_even_page_size(page: int) -> None:
    """`swa_slots`: the pair row of a token is its SWA slot, halved at an even page size (even
    positions hold even SWA slots there, so row swa_slot // 2 is one per even SWA slot)."""
    batch = PrefillBatch(
        (RequestSlice("a", 2, 5, tuple(range(4))), RequestSlice("b", 0, 0, tuple(range(3))))
    )
    cache = KVCache(TINY, 64, swa_slots=20, page_size=page, max_requests=4)
    assert all(t.shape[0] == 20 // page for t in cache.pair_kv.values())
    cache.req_to_token[2, :9] = torch.arange(10, 19)
    cache.req_to_token[0, :3] = torch.arange(30, 33)
    mapping = torch.zeros(64, dtype=torch.long)
    mapping[10:19] = torch.arange(4, 13)  # position p of a on SWA slot 4 + p
    mapping[30:33] = torch.arange(14, 17)
    cache.set_swa_slot_map(mapping)
    tok = _meta(batch, cache, [15, 16, 17, 18, 30, 31, 32])
    read, write = cache.pair_read_rows(tok).tolist(), cache.pair_write_rows(tok).tolist()
    # a reads its partner 4 (SWA slot 8); 6, 8 of a and 0, 2 of b write (SWA 10, 12, 14, 16)
    assert read == [8 // page, -1, -1, -1, -1, -1, -1]
    assert write == [-1, 10 // page, -1, 12 // page, 14 // page, -1, 16 // page]


def test_allocator_refuses_a_cache_whose_swa_rows_an_outside_allocator_maps() -> None:
    """A `swa_slots` cache's SWA rows follow SGLang's map, which PagedAllocator (and so
    PrefillRunner) never writes: refused at construction, not an IndexError in the forward."""
    from dsv4cp.model import DeepseekV41Model
    from dsv4cp.runner import PrefillRunner

    cache = KVCache(TINY, 256, swa_slots=128)
    with pytest.raises(ValueError, match="swa_slots=128.*outside allocator.*SGLang"):
        PagedAllocator(cache)
    with pytest.raises(ValueError, match="without swa_slots"):
        PrefillRunner(DeepseekV41Model(TINY, seed=1), cache=cache)
    PagedAllocator(KVCache(TINY, 256, window_slots=64))  # the window pool it manages itself


def test_meta_device_cache_and_its_views() -> None:
    cache = _flash_cache_for(4096, 64)
    assert cache.swa[0].device.type == "meta" and cache.swa[0].shape[1] == 528
    assert cache.compressed[2].shape[1] == 288 and cache.index[20].shape[1] == 68
    assert cache.compressed[2].shape[0] == (4096 + 64) // 2


@pytest.mark.parametrize("quant", ["none", "qat"])
def test_tiny_formula_equals_a_real_allocation_after_a_prefill(quant: str) -> None:
    """A CPU cache sized for one request of n tokens, filled by the runner: what it allocates
    beyond the dummy page and dummy pair row, and the SWA pages it still holds, is the plan."""
    from dsv4cp.model import DeepseekV41Model
    from dsv4cp.runner import PrefillRunner

    n, page = 90, 4
    model = DeepseekV41Model(TINY, seed=0)
    for block in model.blocks:
        block.attn.quant = quant  # type: ignore[assignment]
    pages = -(-n // page)
    cache = KVCache(
        TINY,
        (pages + 1) * page,
        quant=quant,  # type: ignore[arg-type]
        window_slots=pages * page,  # the whole prompt is one chunk
        max_requests=1,
        max_context=n,
        page_size=page,
    )
    runner = PrefillRunner(model, cache=cache)
    runner.prefill({"a": list(range(n))})
    plan = cache_bytes(TINY, n, quant=quant, page_size=page, dtype=torch.float32)  # type: ignore[arg-type]
    alloc = cache.nbytes_by_kind()
    dummy = {
        "compressed": (page // 2 + page) * cache.row_bytes("compressed"),  # r2 source 1, r1 3
        "index_keys": (page // 2 + page) * cache.row_bytes("index"),
        "pair_state": 2 * TINY.head_dim * 4,
        "slot_tables": 4 + page * 4,  # the dummy page's page-table entry and token ids
    }
    for kind, extra in dummy.items():
        assert alloc[kind] - plan.by_kind[kind] == extra, kind
    held = runner.alloc.swa_pages_held("a") * page * len(cache.swa) * cache.row_bytes("swa")
    assert held == plan.by_kind["swa_window"]
    assert int((cache.swa_page_table >= 0).sum()) - 1 == runner.alloc.swa_pages_held("a")
