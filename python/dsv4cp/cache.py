"""Slot-indexed paged caches for DeepSeek-V4.1 attention, and the page allocator.

Every cache row is addressed by a *token slot* (SGLang's `out_cache_loc` convention), so the
same storage serves dsv4cp's own allocator and SGLang's radix cache:

- one KV pool `[regions · num_slots, D]`: a region per layer for its SWA keys and a region per
  kv-source layer for its compressed keys. A compressed entry j of ratio r lives at the slot of its
  block's last token ((j+1)·r − 1). Attention indexes the pool directly, so sparse attention needs
  no workspace copy;
- index keys per kv source `[num_slots, D_I]`, same addressing as the compressed keys;
- the ratio-2 pair state (fp32 kv and gate of every even token, at its slot) per ratio-2 kv source;
- `req_to_token [max_requests, max_context]`: position → slot per request row.

Slot 0 is reserved as the dummy slot: padding rows write there and nothing valid reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from dsv4cp.config import DeepseekV41Config


class CacheFullError(RuntimeError):
    pass


class KVCache:
    def __init__(
        self,
        config: DeepseekV41Config,
        num_slots: int,
        *,
        max_requests: int = 64,
        max_context: int = 4096,
        page_size: int = 16,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        req_to_token: Tensor | None = None,
    ) -> None:
        if num_slots < 2:
            raise ValueError("KVCache: num_slots must be >= 2 (slot 0 is the dummy slot)")
        if page_size < 1:
            raise ValueError("KVCache: page_size must be >= 1")
        self.config = config
        self.num_slots = num_slots
        self.page_size = page_size
        self.device = torch.device(device)
        self.dtype = dtype
        roles = config.layer_roles()
        regions = 0
        self.swa_region: dict[int, int] = {}
        self.comp_region: dict[int, int] = {}
        for role in roles:
            self.swa_region[role.layer] = regions
            regions += 1
        for role in roles:
            if role.owns_compressor:
                self.comp_region[role.layer] = regions
                regions += 1
        if regions * num_slots >= 2**31:
            raise ValueError("KVCache: the KV pool would exceed int32 indexing; use fewer slots")
        d, di = config.head_dim, config.index_head_dim
        self.kv_pool = torch.zeros(regions * num_slots, d, dtype=dtype, device=self.device)
        self.index_k = {
            r.layer: torch.zeros(num_slots, di, dtype=dtype, device=self.device)
            for r in roles
            if r.owns_compressor
        }
        self.pair_kv = {
            r.layer: torch.zeros(num_slots, d, dtype=torch.float32, device=self.device)
            for r in roles
            if r.owns_compressor and r.ratio == 2
        }
        self.pair_gate = {k: torch.zeros_like(v) for k, v in self.pair_kv.items()}
        # The raw token id at each slot: Engram's n-gram history (layers/engram_hashes.py).
        self.token_ids = torch.zeros(num_slots, dtype=torch.int32, device=self.device)
        if req_to_token is None:
            req_to_token = torch.zeros(
                max_requests, max_context, dtype=torch.long, device=self.device
            )
        self.req_to_token = req_to_token
        self.max_requests, self.max_context = req_to_token.shape

    # ------------------------------------------------------------------ views
    def region_base(self, region: int) -> int:
        return region * self.num_slots

    def swa_base(self, layer: int) -> int:
        return self.region_base(self.swa_region[layer])

    def comp_base(self, kv_source: int) -> int:
        return self.region_base(self.comp_region[kv_source])

    def swa_cache(self, layer: int) -> Tensor:
        b = self.swa_base(layer)
        return self.kv_pool[b : b + self.num_slots]

    def comp_cache(self, kv_source: int) -> Tensor:
        b = self.comp_base(kv_source)
        return self.kv_pool[b : b + self.num_slots]

    def state_dict_view(self) -> dict[str, Tensor]:
        """Every cache tensor by name (for tests comparing caches)."""
        out = {f"swa.{i}": self.swa_cache(i) for i in self.swa_region}
        out.update({f"comp.{i}": self.comp_cache(i) for i in self.comp_region})
        out.update({f"index_k.{i}": t for i, t in self.index_k.items()})
        out.update({f"pair_kv.{i}": t for i, t in self.pair_kv.items()})
        out.update({f"pair_gate.{i}": t for i, t in self.pair_gate.items()})
        return out


@dataclass
class RequestState:
    row: int
    length: int = 0
    pages: list[int] = field(default_factory=list)


@dataclass
class Reservation:
    rid: object
    row: int
    start: int
    slots: list[int]
    new_pages: list[int]
    new_request: bool


class PagedAllocator:
    """Hands out pages of `page_size` slots and keeps `req_to_token` rows up to date.

    `reserve` validates and returns a Reservation without touching the cache; `write_table` fills
    the new positions of the request's `req_to_token` row before the forward; `commit` records the
    new length; `rollback` returns the pages and clears those positions again. Nothing a failed
    batch did is visible afterwards.
    """

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.page_size = cache.page_size
        n_pages = cache.num_slots // self.page_size
        if n_pages < 2:
            raise ValueError("PagedAllocator: num_slots must hold at least 2 pages")
        self.free_pages = list(range(n_pages - 1, 0, -1))  # page 0 holds the dummy slot
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
        new_pages = [self.free_pages.pop() for _ in range(need)]
        pages = (st.pages if st else []) + new_pages
        slots = [
            pages[p // self.page_size] * self.page_size + p % self.page_size
            for p in range(cached, end)
        ]
        row = st.row if st else self.free_rows.pop()
        return Reservation(rid, row, cached, slots, new_pages, st is None)

    def rollback(self, res: Reservation) -> None:
        self.free_pages.extend(reversed(res.new_pages))
        if res.new_request:
            self.free_rows.append(res.row)
        if res.slots:
            self.cache.req_to_token[res.row, res.start : res.start + len(res.slots)] = 0

    def commit(self, res: Reservation) -> None:
        if res.new_request:
            self.requests[res.rid] = RequestState(res.row)
        st = self.requests[res.rid]
        st.pages.extend(res.new_pages)
        st.length = res.start + len(res.slots)

    def write_table(self, res: Reservation) -> None:
        """Write the new positions' slots before the forward (reads of them come from it)."""
        if res.slots:
            self.cache.req_to_token[res.row, res.start : res.start + len(res.slots)] = torch.tensor(
                res.slots, dtype=torch.long, device=self.cache.req_to_token.device
            )

    def free(self, rid: object) -> None:
        st = self.requests.pop(rid, None)
        if st is None:
            raise KeyError(f"unknown request {rid!r}")
        self.free_pages.extend(reversed(st.pages))
        self.free_rows.append(st.row)
        self.cache.req_to_token[st.row].zero_()
