"""The attention caches of DeepSeek-V4.1 (`kv_cache`: storage as the numerics define it), their
capacity plan (`plan`) and dsv4cp's own allocator (`allocator`); docs/caches.md."""

from dsv4cp.cache.allocator import PagedAllocator, RequestState, Reservation
from dsv4cp.cache.kv_cache import (
    CACHE_KINDS,
    CacheFormats,
    CacheFullError,
    CacheKind,
    KVCache,
    entry_div,
)
from dsv4cp.cache.plan import CacheBytes, cache_bytes, swa_window_rows

__all__ = [
    "CACHE_KINDS",
    "CacheBytes",
    "CacheFormats",
    "CacheFullError",
    "CacheKind",
    "KVCache",
    "PagedAllocator",
    "Reservation",
    "RequestState",
    "cache_bytes",
    "entry_div",
    "swa_window_rows",
]
