"""The attention caches of DeepSeek-V4.1, stored as the numerics define them.

Every cache row is found from a *token slot* (SGLang's `out_cache_loc` convention), so the same
storage serves dsv4cp's own allocator and SGLang's radix cache (docs/caches.md):

- SWA keys, one pool per layer, rows found through `swa_page_table` (token page → SWA page, −1:
  not held). With `window_slots=None` the table is the identity and every token slot keeps its
  key; with `window_slots=N` the pool holds N rows and `PagedAllocator` frees a request's pages
  once they are older than its window (the reference keeps a ring of `window_size` rows per
  request: model.py `Attention.window_kv_cache`); with `swa_slots=N` an external allocator
  owns the window (SGLang's hybrid-SWA allocator): the pool holds N rows and `swa_slot_map`
  (token slot → SWA slot, 0: not held, SGLang's `full_to_swa_index_mapping`) finds them;
- compressed keys and index keys, one pool each per kv source: entry j of ratio r at the slot of
  its block's last token ((j+1)·r − 1), stored at row slot // r when page_size is a multiple of r
  (slot ≡ position mod page_size, so each slot // r holds one entry; reference:
  `compress_kv_cache`, `Indexer.k_cache` of `max_seq_len // ratio` rows);
- the ratio-2 pair state (fp32 kv and gate of an even token whose partner has not come yet): one
  pending row per request with a window; with `swa_slots` (the partner is read only inside the
  window) one row per even SWA slot, row swa_slot // 2, at an even page size (SGLang's paged
  SWA allocator keeps swa_slot ≡ position mod page, so only even SWA slots hold even
  positions; the SGLang engine checks it), one row per SWA slot at an odd page size; else one
  row per token slot (reference: `Compressor.kv_state` / `score_state`, `ratio` rows per
  request);
- `req_to_token [max_requests, max_context]`: position → slot per request row.

Storage formats follow the quant mode (`ops.kv_format`): `none` keeps dense rows in the cache
dtype; `qat` keeps SWA keys fp8 + ue8m0 scales, compressed keys fp4 + e4m3 scales and index keys
fp4 + ue8m0 scales, 528 / 288 / 68 bytes per row at Flash dims. `store_values=True` keeps the
same numerics as dense dequantized values (tests compare the two). Slot 0 is the dummy slot:
padding rows write there and nothing valid reads it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from dsv4cp.config import DeepseekV41Config
from dsv4cp.ops import pool_rows
from dsv4cp.ops.kv_format import (
    KVFormat,
    decode_rows,
    row_bytes,
    row_width,
    storage_dtype,
    stored_rows,
)
from dsv4cp.ops.quant import QuantMode, check_quant_mode

if TYPE_CHECKING:
    from dsv4cp.batch import TokenMeta

CacheKind = Literal["swa", "compressed", "index"]
CACHE_KINDS: tuple[CacheKind, ...] = ("swa", "compressed", "index")


class CacheFullError(RuntimeError):
    pass


@dataclass(frozen=True)
class CacheFormats:
    """The numerics format of each cache kind (what `encode` quantizes to)."""

    swa: KVFormat
    compressed: KVFormat
    index: KVFormat

    @classmethod
    def for_quant(cls, quant: str) -> CacheFormats:
        if check_quant_mode(quant) == "none":
            return cls("dense", "dense", "dense")
        return cls("fp8_ue8m0_32", "fp4_e4m3_16", "fp4_ue8m0_32")

    def of(self, kind: CacheKind) -> KVFormat:
        fmt: KVFormat = getattr(self, kind)
        return fmt


def entry_div(ratio: int, page_size: int) -> int:
    """Slots per compressed row: r when pages hold whole blocks (compact), else 1."""
    return ratio if page_size % ratio == 0 else 1


class KVCache:
    def __init__(
        self,
        config: DeepseekV41Config,
        num_slots: int,
        *,
        quant: QuantMode = "none",
        store_values: bool = False,
        window_slots: int | None = None,
        max_requests: int = 64,
        max_context: int = 4096,
        page_size: int = 16,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        req_to_token: Tensor | None = None,
        swa_slots: int | None = None,
    ) -> None:
        if num_slots < 2:
            raise ValueError("KVCache: num_slots must be >= 2 (slot 0 is the dummy slot)")
        if page_size < 1:
            raise ValueError("KVCache: page_size must be >= 1")
        if window_slots is not None and window_slots < 1:
            raise ValueError(f"KVCache: window_slots must be >= 1 or None, got {window_slots}")
        if swa_slots is not None and (swa_slots < 2 or window_slots is not None):
            raise ValueError(
                f"KVCache: swa_slots must be >= 2 (slot 0 is the dummy) and excludes "
                f"window_slots, got swa_slots={swa_slots}, window_slots={window_slots}"
            )
        self.config = config
        self.num_slots = num_slots
        self.page_size = page_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.quant = check_quant_mode(quant)
        self.numerics = CacheFormats.for_quant(quant)
        # what readers see: the stored format, dense when values are stored
        self.formats = CacheFormats("dense", "dense", "dense") if store_values else self.numerics
        self.windowed = window_slots is not None
        # swa_slots: an external allocator's SWA slots index the SWA and pair-state rows
        self.swa_slots = swa_slots
        self.swa_slot_map: Tensor | None = None
        self.num_pages = -(-num_slots // page_size)
        roles = config.layer_roles()
        self.kv_sources = {r.layer: r.ratio for r in roles if r.owns_compressor}
        self.entry_div = {r: entry_div(r, page_size) for r in set(self.kv_sources.values())}
        dims = self.dims()

        def pool(kind: CacheKind, rows: int) -> Tensor:
            fmt = self.formats.of(kind)
            width = row_width(fmt, dims[kind])
            dt = dtype if fmt == "dense" else torch.uint8
            return torch.zeros(rows, width, dtype=dt, device=self.device)

        if swa_slots is not None:
            swa_rows = swa_slots
            table = torch.arange(self.num_pages, dtype=torch.int32, device=self.device)
            # nothing held until the owner sets its map (`set_swa_slot_map`)
            self.swa_slot_map = torch.zeros(1, dtype=torch.long, device=self.device).expand(
                num_slots
            )
        elif window_slots is None:
            swa_rows = num_slots
            table = torch.arange(self.num_pages, dtype=torch.int32, device=self.device)
        else:
            swa_pages = -(-window_slots // page_size) + 1  # page 0: the dummy slot's
            swa_rows = swa_pages * page_size
            table = torch.full((self.num_pages,), -1, dtype=torch.int32, device=self.device)
            table[0] = 0
        self.swa_pages = -(-swa_rows // page_size)
        self.swa_page_table = table
        self.swa = {r.layer: pool("swa", swa_rows) for r in roles}
        self.compressed = {
            s: pool("compressed", self.entry_rows_needed(r)) for s, r in self.kv_sources.items()
        }
        self.index = {
            s: pool("index", self.entry_rows_needed(r)) for s, r in self.kv_sources.items()
        }
        # The raw token id at each slot: Engram's n-gram history (layers/engram_hashes.py).
        self.token_ids = torch.zeros(num_slots, dtype=torch.int32, device=self.device)
        if req_to_token is None:
            req_to_token = torch.zeros(
                max_requests, max_context, dtype=torch.long, device=self.device
            )
        self.req_to_token = req_to_token
        self.max_requests, self.max_context = req_to_token.shape
        # windowed: one pending row per request row, then a spare row (the former dummy row:
        # nothing writes it since -1 means "no row"; cache_bytes and the tests still count it)
        pair_rows = self.max_requests + 1 if self.windowed else num_slots
        # swa_slots at an even page size: even SWA slots only (row swa_slot // 2)
        self.pair_div = 2 if swa_slots is not None and page_size % 2 == 0 else 1
        if swa_slots is not None:
            pair_rows = -(-swa_slots // self.pair_div)
        d = config.head_dim
        self.pair_kv = {
            s: torch.zeros(pair_rows, d, dtype=torch.float32, device=self.device)
            for s, r in self.kv_sources.items()
            if r == 2
        }
        self.pair_gate = {k: torch.zeros_like(v) for k, v in self.pair_kv.items()}

    # ------------------------------------------------------------------ geometry
    def dims(self) -> dict[CacheKind, int]:
        c = self.config
        return {"swa": c.head_dim, "compressed": c.head_dim, "index": c.index_head_dim}

    def entry_rows_needed(self, ratio: int) -> int:
        return -(-self.num_slots // self.entry_div[ratio])

    def row_bytes(self, kind: CacheKind) -> int:
        return row_bytes(self.formats.of(kind), self.dims()[kind], self.dtype)

    # ------------------------------------------------------------------ rows (on device)
    def set_swa_slot_map(self, mapping: Tensor) -> None:
        """`swa_slots` mode: token slot → SWA slot (0: not held; slot 0 → 0, the dummy row),
        an entry for every slot the owner hands out. The owner's tensor is kept, not copied: its
        in-place updates (allocation, window frees) are what the next forward reads."""
        if self.swa_slots is None:
            raise ValueError("KVCache.set_swa_slot_map: the cache was built without swa_slots")
        if mapping.dim() != 1 or mapping.shape[0] < 2:
            raise ValueError(
                "KVCache.set_swa_slot_map: need a 1-d map with an entry per slot handed out, "
                f"got shape {tuple(mapping.shape)}"
            )
        if mapping.device.type != self.device.type:
            raise ValueError(
                f"KVCache.set_swa_slot_map: map on {mapping.device}, cache on {self.device}"
            )
        self.swa_slot_map = mapping

    @property
    def swa_pool_map(self) -> tuple[Tensor | None, Tensor, int]:
        """(slot_map, page_table, page_size): the token slot → SWA row map's arguments of
        `ops.pool_rows` / `routing` `swa_rows` and `window_rows` (slot_map None: the pages)."""
        return self.swa_slot_map, self.swa_page_table, self.page_size

    def swa_rows(self, slots: Tensor) -> Tensor:
        """int64 SWA pool rows of token slots (−1 for slot −1 or a page / SWA slot not held):
        `ops.pool_rows.swa_rows` over this cache's map."""
        return pool_rows.swa_rows(slots, *self.swa_pool_map)

    def entry_rows(self, ratio: int, slots: Tensor) -> Tensor:
        """Compressed / index rows of entry slots (−1 stays −1)."""
        div = self.entry_div[ratio]
        if div == 1:
            return slots
        return torch.where(slots >= 0, torch.div(slots, div, rounding_mode="floor"), -1)

    def pair_read_rows(self, tok: TokenMeta) -> Tensor:
        """Where the first new token of a forward starting at an odd position finds its even
        partner; −1 for other rows (their partner is the row above)."""
        first = tok.pair_partner_from_state() & (tok.positions % 2 == 1)
        if self.windowed:
            return torch.where(first, tok.req_row, -1)
        rows = self._pair_rows(torch.where(first, tok.slot_of(tok.positions - 1), 0))
        return torch.where(first, rows, -1)

    def pair_write_rows(self, tok: TokenMeta) -> Tensor:
        """Windowed: the request's last token, when it is even (a later forward starts at its
        odd partner), writes the request's pending row. Otherwise every even token writes its
        slot: another request sharing a prefix of odd length may start at its partner. −1: the
        row writes nothing."""
        even = (tok.positions % 2 == 0) & tok.valid
        if self.windowed:
            return torch.where(even & (tok.positions == tok.end - 1), tok.req_row, -1)
        return torch.where(even, self._pair_rows(torch.where(even, tok.slots, 0)), -1)

    def _pair_rows(self, slots: Tensor) -> Tensor:
        """Slot-indexed pair rows: the slot itself, or its SWA slot (`swa_slots` mode; a slot
        not held reads and writes the dummy row 0; the engine checks reads are held), halved at
        an even page size (`pair_div`: an even position's SWA slot is even, so each even SWA
        slot has its own row; an odd slot aliases its even neighbour's row, which only
        `slot_view` reads; the engine checks the parity, `check_pair_parity`)."""
        if self.swa_slots is None:
            return slots
        rows = self.swa_rows(slots).clamp(min=0)
        if self.pair_div == 1:
            return rows
        return torch.div(rows, self.pair_div, rounding_mode="floor")

    # ------------------------------------------------------------------ encode / decode
    def encode(self, kind: CacheKind, x: Tensor) -> Tensor:
        """Key rows [n, dim] as this cache stores them (quantized, or their dequantized values
        in the cache dtype when values are stored)."""
        return stored_rows(x, self.numerics.of(kind), self.stored_dtype(kind))

    def stored_dtype(self, kind: CacheKind) -> torch.dtype:
        """The dtype of the kind's cache tensors: uint8 when they hold codes, else the dtype."""
        return storage_dtype(self.formats.of(kind), self.dtype)

    def decode(self, kind: CacheKind, rows: Tensor) -> Tensor:
        return decode_rows(rows, self.formats.of(kind), self.dims()[kind])

    # ------------------------------------------------------------------ inspection
    def state_dict_view(self) -> dict[str, Tensor]:
        """Every cache tensor by name, as stored (snapshots; `slot_view` reads by slot)."""
        out = {f"swa.{i}": t for i, t in self.swa.items()}
        out.update({f"comp.{i}": t for i, t in self.compressed.items()})
        out.update({f"index_k.{i}": t for i, t in self.index.items()})
        out.update({f"pair_kv.{i}": t for i, t in self.pair_kv.items()})
        out.update({f"pair_gate.{i}": t for i, t in self.pair_gate.items()})
        out["swa_page_table"] = self.swa_page_table
        out["token_ids"] = self.token_ids
        return out

    def slot_view(self, slots: Tensor) -> dict[str, Tensor]:
        """fp32 key values at these token slots per cache (what comparisons by position read):
        SWA keys (0 where not held), compressed and index rows, and the pair state when it is
        slot-indexed. Rows of slots that are not entry slots alias a neighbour's entry (so do
        the pair rows of odd SWA slots at an even page size)."""
        zero = torch.zeros((), device=slots.device)
        out: dict[str, Tensor] = {}
        rows = self.swa_rows(slots)
        for i, t in self.swa.items():
            v = self.decode("swa", t[rows.clamp(min=0)])
            out[f"swa.{i}"] = torch.where((rows >= 0)[:, None], v, zero)
        for s, r in self.kv_sources.items():
            e = self.entry_rows(r, slots)
            out[f"comp.{s}"] = self.decode("compressed", self.compressed[s][e])
            out[f"index_k.{s}"] = self.decode("index", self.index[s][e])
        if not self.windowed:
            pair = self._pair_rows(slots)
            for s, t in self.pair_kv.items():
                out[f"pair_kv.{s}"] = t[pair]
                out[f"pair_gate.{s}"] = self.pair_gate[s][pair]
        return out

    def nbytes_by_kind(self) -> dict[str, int]:
        """Bytes allocated per kind (works on the meta device)."""

        def size(ts: Iterable[Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in ts)

        return {
            "swa_window": size(self.swa.values()),
            "compressed": size(self.compressed.values()),
            "index_keys": size(self.index.values()),
            "pair_state": size([*self.pair_kv.values(), *self.pair_gate.values()]),
            "slot_tables": size([self.req_to_token, self.swa_page_table, self.token_ids]),
        }
