"""`PagedAllocator`: dsv4cp's own allocator of a `KVCache` (pages of token slots, request rows,
the SWA window pool), transactional: `reserve` / `write_table` / `commit` / `rollback`
(docs/caches.md). Under SGLang its allocator and radix cache take this role."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from dsv4cp.cache.kv_cache import CacheFullError, KVCache


@dataclass
class RequestState:
    row: int
    length: int = 0
    pages: list[int] = field(default_factory=list)
    swa_pages: list[int] = field(default_factory=list)  # windowed: the SWA page of each page
    swa_from: int = 0  # windowed: index in `pages` of the first page still holding SWA keys


@dataclass
class Reservation:
    rid: object
    row: int
    start: int
    slots: list[int]
    new_pages: list[int]
    new_request: bool
    new_swa_pages: list[int] = field(default_factory=list)
    pair_backup: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)


class PagedAllocator:
    """Hands out pages of `page_size` slots and keeps `req_to_token` rows up to date.

    `reserve` validates and returns a Reservation without touching the cache; `write_table` fills
    the new positions of the request's `req_to_token` row (and, windowed, the SWA page table)
    before the forward; `commit` records the new length and, windowed, frees the SWA pages now
    older than the request's window; `rollback` returns the pages, clears those positions and
    restores the request's pending pair row. Nothing a failed batch did is visible afterwards.
    """

    def __init__(self, cache: KVCache) -> None:
        if cache.swa_slots is not None:
            raise ValueError(
                f"PagedAllocator: the cache was built with swa_slots={cache.swa_slots}: its SWA "
                "and pair-state rows are mapped by an outside allocator (SGLang's hybrid-SWA "
                "pools, `KVCache.set_swa_slot_map`), which this allocator does not drive; build "
                "the cache without swa_slots (a row per token slot) or with window_slots (the "
                "SWA window pool this allocator manages)"
            )
        self.cache = cache
        self.page_size = cache.page_size
        n_pages = cache.num_slots // self.page_size
        if n_pages < 2:
            raise ValueError("PagedAllocator: num_slots must hold at least 2 pages")
        self.free_pages = list(range(n_pages - 1, 0, -1))  # page 0 holds the dummy slot
        self.free_swa_pages = list(range(cache.swa_pages - 1, 0, -1)) if cache.windowed else []
        self.requests: dict[object, RequestState] = {}
        self.free_rows = list(range(cache.max_requests - 1, -1, -1))

    def reserve(self, rid: object, n_new: int, start: int | None = None) -> Reservation:
        st = self.requests.get(rid)
        cached = 0 if st is None else st.length
        if start is not None and start != cached:
            raise ValueError(
                f"request {rid!r}: positions start at {start} but the cache holds {cached} tokens"
            )
        end = cached + n_new
        if end > self.cache.max_context:
            raise CacheFullError(
                f"request {rid!r}: {end} tokens exceed max_context={self.cache.max_context}"
            )
        if st is None and not self.free_rows:
            raise CacheFullError(f"no free request rows (max_requests={self.cache.max_requests})")
        have = 0 if st is None else len(st.pages) * self.page_size
        need = -(-max(end - have, 0) // self.page_size)
        if need > len(self.free_pages):
            raise CacheFullError(
                f"request {rid!r}: needs {need} more pages of {self.page_size} slots, "
                f"{len(self.free_pages)} free"
            )
        if self.cache.windowed and need > len(self.free_swa_pages):
            raise CacheFullError(
                f"request {rid!r}: needs {need} more SWA window pages of {self.page_size} rows, "
                f"{len(self.free_swa_pages)} free (KVCache window_slots)"
            )
        new_pages = [self.free_pages.pop() for _ in range(need)]
        new_swa = [self.free_swa_pages.pop() for _ in range(need)] if self.cache.windowed else []
        pages = (st.pages if st else []) + new_pages
        slots = [
            pages[p // self.page_size] * self.page_size + p % self.page_size
            for p in range(cached, end)
        ]
        row = st.row if st else self.free_rows.pop()
        backup = {}
        if st is not None and self.cache.windowed:
            backup = {
                s: (t[row].clone(), self.cache.pair_gate[s][row].clone())
                for s, t in self.cache.pair_kv.items()
            }
        return Reservation(rid, row, cached, slots, new_pages, st is None, new_swa, backup)

    def _set_swa_pages(self, pages: list[int], swa_pages: list[int] | int) -> None:
        if not pages:
            return
        table = self.cache.swa_page_table
        idx = torch.tensor(pages, dtype=torch.long, device=table.device)
        if isinstance(swa_pages, int):
            table[idx] = swa_pages
        else:
            table[idx] = torch.tensor(swa_pages, dtype=table.dtype, device=table.device)

    def rollback(self, res: Reservation) -> None:
        self.free_pages.extend(reversed(res.new_pages))
        if self.cache.windowed:
            self._set_swa_pages(res.new_pages, -1)
            self.free_swa_pages.extend(reversed(res.new_swa_pages))
        for s, (kv, gate) in res.pair_backup.items():
            self.cache.pair_kv[s][res.row] = kv
            self.cache.pair_gate[s][res.row] = gate
        if res.new_request:
            self.free_rows.append(res.row)
        if res.slots:
            self.cache.req_to_token[res.row, res.start : res.start + len(res.slots)] = 0

    def commit(self, res: Reservation) -> None:
        if res.new_request:
            self.requests[res.rid] = RequestState(res.row)
        st = self.requests[res.rid]
        st.pages.extend(res.new_pages)
        st.swa_pages.extend(res.new_swa_pages)
        st.length = res.start + len(res.slots)
        if self.cache.windowed:
            self._release_window(st)

    def _release_window(self, st: RequestState, *, keep_from: int | None = None) -> None:
        """Free the SWA pages of pages whose every position precedes `keep_from` (default: the
        first position the request's next token reads, length − window + 1)."""
        if keep_from is None:
            keep_from = st.length - self.cache.config.sliding_window + 1
        stop = min(max(keep_from, 0) // self.page_size, len(st.pages))
        if stop <= st.swa_from:
            return
        self.free_swa_pages.extend(reversed(st.swa_pages[st.swa_from : stop]))
        self._set_swa_pages(st.pages[st.swa_from : stop], -1)
        st.swa_from = stop

    def write_table(self, res: Reservation) -> None:
        """Write the new positions' slots before the forward (reads of them come from it)."""
        if res.slots:
            self.cache.req_to_token[res.row, res.start : res.start + len(res.slots)] = torch.tensor(
                res.slots, dtype=torch.long, device=self.cache.req_to_token.device
            )
        if self.cache.windowed:
            self._set_swa_pages(res.new_pages, res.new_swa_pages)

    def free(self, rid: object) -> None:
        st = self.requests.pop(rid, None)
        if st is None:
            raise KeyError(f"unknown request {rid!r}")
        if self.cache.windowed:
            self._release_window(st, keep_from=st.length + self.page_size)
        self.free_pages.extend(reversed(st.pages))
        self.free_rows.append(st.row)
        self.cache.req_to_token[st.row].zero_()

    def swa_pages_held(self, rid: object) -> int:
        """SWA pages the request holds now (windowed), or all its pages."""
        st = self.requests[rid]
        return len(st.pages) - st.swa_from
