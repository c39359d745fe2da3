"""SGLang `ForwardBatch` → dsv4cp batch: which tokens of which request go where.

SGLang's conventions (0.5.23, `model_executor/forward_batch_info.py`):

- `forward_mode`: EXTEND (prefill, chunked-prefill chunks, prefix hits), DECODE (one token per
  request), MIXED (the eager runner turns it into EXTEND), IDLE (no tokens; DP attention only);
- `req_pool_indices` [B]: each request's row of `req_to_token` ([rows, context] int32,
  position → token slot; SGLang fills the new positions before the forward);
- `seq_lens` [B]: tokens of each request after this forward; `extend_prefix_lens` /
  `extend_seq_lens` [B] (EXTEND): cached prefix (radix hit or earlier chunks) and new tokens;
- `out_cache_loc` [T]: the write slot of each new token, flattened request-major; slot 0 is
  SGLang's padding slot, as it is dsv4cp's dummy slot.

A dsv4cp `RequestSlice(start=prefix, token_ids=new)` of row `req_pool_indices[i]` is exactly that,
so the adapter is bookkeeping: no token is re-laid out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any  # SGLang's ForwardBatch: not imported here (sglang is optional)

import torch
from torch import Tensor

from dsv4cp.batch import PrefillBatch, RequestSlice


@dataclass(frozen=True)
class SGLangBatch:
    """One SGLang forward in dsv4cp terms (host lists are small: one entry per request)."""

    mode: str  # "extend" | "decode" | "idle"
    req_rows: tuple[int, ...]
    starts: tuple[int, ...]  # cached tokens before this forward
    new_lens: tuple[int, ...]  # new tokens in this forward
    input_ids: Tensor  # int64 [T]
    slots: Tensor  # int64 [T] write slots (out_cache_loc)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(s + n for s, n in zip(self.starts, self.new_lens))

    def prefill_batch(self) -> PrefillBatch:
        ids = self.input_ids.tolist()
        reqs, o = [], 0
        for b, (row, start, n) in enumerate(zip(self.req_rows, self.starts, self.new_lens)):
            if n:  # a request with no new tokens contributes no rows
                reqs.append(RequestSlice(b, row, start, tuple(ids[o : o + n])))
            o += n
        return PrefillBatch(tuple(reqs))


def _host_list(values: Any) -> list[int]:
    if isinstance(values, Tensor):
        return [int(v) for v in values.tolist()]
    return [int(v) for v in values]


def mode_of(forward_batch: Any) -> str:
    mode = forward_batch.forward_mode
    if mode.is_idle():
        return "idle"
    if mode.is_decode():
        return "decode"
    if mode.is_target_verify() or mode.is_draft_extend_v2():
        raise NotImplementedError("dsv4cp: speculative decoding is not supported")
    if mode.is_extend() or mode.is_mixed():
        return "extend"
    raise NotImplementedError(f"dsv4cp: forward mode {mode!r} is not supported")


def from_forward_batch(forward_batch: Any) -> SGLangBatch:
    """Read one ForwardBatch; raises ValueError when its fields disagree with each other."""
    mode = mode_of(forward_batch)
    ids = forward_batch.input_ids.reshape(-1).long()
    slots = forward_batch.out_cache_loc.reshape(-1).long()
    if mode == "idle":
        return SGLangBatch("idle", (), (), (), ids[:0], slots[:0])
    rows = _host_list(
        forward_batch.req_pool_indices_cpu
        if getattr(forward_batch, "req_pool_indices_cpu", None) is not None
        else forward_batch.req_pool_indices
    )
    seq = _host_list(
        forward_batch.seq_lens_cpu
        if getattr(forward_batch, "seq_lens_cpu", None) is not None
        else forward_batch.seq_lens
    )[: len(rows)]
    if mode == "decode":
        new = [1] * len(rows)
        starts = [s - 1 for s in seq]
    else:
        new = _host_list(
            forward_batch.extend_seq_lens_cpu
            if forward_batch.extend_seq_lens_cpu is not None
            else forward_batch.extend_seq_lens
        )
        starts = _host_list(
            forward_batch.extend_prefix_lens_cpu
            if forward_batch.extend_prefix_lens_cpu is not None
            else forward_batch.extend_prefix_lens
        )
    total = sum(new)
    if not (len(new) == len(starts) == len(rows)):
        raise ValueError(
            f"dsv4cp: batch of {len(rows)} requests has {len(starts)} prefixes, {len(new)} lengths"
        )
    if ids.shape[0] != total or slots.shape[0] < total:
        raise ValueError(
            f"dsv4cp: {ids.shape[0]} input ids and {slots.shape[0]} write slots for "
            f"{total} new tokens"
        )
    for s, n, full in zip(starts, new, seq):
        if s < 0 or n < 0 or s + n != full:
            raise ValueError(f"dsv4cp: prefix {s} + new {n} != sequence length {full}")
    positions = getattr(forward_batch, "positions", None)
    if positions is not None and positions.numel() >= total:
        expect = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, new)])
        if not torch.equal(positions.reshape(-1)[:total].long().cpu(), expect):
            raise ValueError("dsv4cp: ForwardBatch.positions are not prefix + 0..n-1 per request")
    return SGLangBatch(mode, tuple(rows), tuple(starts), tuple(new), ids, slots[:total])


def sync_req_to_token(dst: Tensor, src: Tensor, batch: SGLangBatch) -> None:
    """Copy the batch's rows of SGLang's int32 `req_to_token` into dsv4cp's int64 table.

    Only positions < end are live; the rest of a row is never read by this forward."""
    if not batch.req_rows:
        return
    width = max(batch.ends)
    rows = torch.tensor(batch.req_rows, dtype=torch.long, device=src.device)
    dst[rows.to(dst.device), :width] = src[rows, :width].to(dst.device, torch.long)
