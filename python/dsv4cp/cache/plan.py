"""Capacity planning: what the caches of one request of N tokens take, per kind
(`dsv4cp cache-size`; docs/caches.md). Equals what `KVCache` allocates for that request
(tests/test_cache.py checks it on the meta device)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4cp.cache.kv_cache import CacheFormats, entry_div
from dsv4cp.config import DeepseekV41Config
from dsv4cp.ops.kv_format import row_bytes
from dsv4cp.ops.quant import QuantMode


@dataclass(frozen=True)
class CacheBytes:
    tokens: int
    by_kind: dict[str, int]
    rows: dict[str, int]  # rows held per kind (per layer or kv source, summed)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    @property
    def per_token(self) -> float:
        return self.total / max(self.tokens, 1)


def swa_window_rows(tokens: int, window: int, page_size: int) -> int:
    """SWA rows one request of `tokens` keeps per layer once its prefill is committed: the pages
    holding positions ≥ tokens − window + 1 (what its next token reads)."""
    if tokens <= 0:
        return 0
    need_from = max(0, tokens - window + 1)
    pages = -(-tokens // page_size) - need_from // page_size
    return pages * page_size


def cache_bytes(
    config: DeepseekV41Config,
    tokens: int,
    *,
    quant: QuantMode = "qat",
    page_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    windowed: bool = True,
    swa_full_ratio: float | None = None,
) -> CacheBytes:
    """What the caches of one request of `tokens` tokens take (bytes per kind).

    Per layer: the SWA rows of its window (`swa_window_rows`; every slot when not windowed);
    per kv source of ratio r: its compressed and index rows, one per r slots of the request's
    pages (compact addressing; one per slot when page_size is not a multiple of r); per ratio-2
    kv source: the pair state, one pending row of fp32 kv and gate (one per slot when not
    windowed); the request's `req_to_token` row (int64 per position) and its SWA page table
    entries (int32 per page), and the token id at each of its slots (int32, Engram's n-gram
    history). Equals what `KVCache` allocates for exactly this request, less
    the dummy page and dummy pair row (tests/test_cache.py checks it on the meta device).

    `swa_full_ratio=R` (the SGLang integration's hybrid-SWA pools, `windowed` ignored): SWA
    rows per SWA slot, ⌊R · slots⌋ rounded down to pages, SGLang's SWA pool for `slots` full
    slots (`--swa-full-tokens-ratio`), and ratio-2 pair rows per even SWA slot at an even page
    size (half the SWA slots), per SWA slot at an odd one (`KVCache.pair_div`): a pool's cost
    per token, whatever it holds at the moment.
    """
    if tokens < 0:
        raise ValueError(f"cache_bytes: tokens must be >= 0, got {tokens}")
    if page_size < 1:
        raise ValueError(f"cache_bytes: page_size must be >= 1, got {page_size}")
    if swa_full_ratio is not None and not 0 < swa_full_ratio <= 1:
        raise ValueError(f"cache_bytes: swa_full_ratio must be in (0, 1], got {swa_full_ratio}")
    fmt = CacheFormats.for_quant(quant)
    c = config
    pages = -(-tokens // page_size)
    slots = pages * page_size
    roles = c.layer_roles()
    if swa_full_ratio is not None:
        per_layer = int(slots * swa_full_ratio) // page_size * page_size
        pair_per_source = per_layer // 2 if page_size % 2 == 0 else per_layer
    elif windowed:
        per_layer = swa_window_rows(tokens, c.sliding_window, page_size)
        pair_per_source = 1 if tokens else 0
    else:
        per_layer = pair_per_source = slots
    swa_rows = per_layer * len(roles)
    comp_rows = 0
    pair_rows = 0
    for r in roles:
        if r.owns_compressor:
            comp_rows += slots // entry_div(r.ratio, page_size)
            if r.ratio == 2:
                pair_rows += pair_per_source * 2  # kv and gate
    by_kind = {
        "swa_window": swa_rows * row_bytes(fmt.swa, c.head_dim, dtype),
        "compressed": comp_rows * row_bytes(fmt.compressed, c.head_dim, dtype),
        "index_keys": comp_rows * row_bytes(fmt.index, c.index_head_dim, dtype),
        "pair_state": pair_rows * c.head_dim * 4,
        "slot_tables": tokens * 8 + pages * 4 + slots * 4,  # + token_ids, int32 per slot
    }
    rows = {
        "swa_window": swa_rows,
        "compressed": comp_rows,
        "index_keys": comp_rows,
        "pair_state": pair_rows,
    }
    return CacheBytes(tokens, by_kind, rows)
