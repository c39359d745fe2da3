"""Engram n-gram windows read through the token slots (the runner's and SGLang's addressing).

The hash of the token at position p needs the compressed ids at p, p-1, …, p-N+1 of its request
(``ops/engram_hash.py``, DeepSeek reference ``engram.py: NgramHashState.forward``). Under a
paged cache those positions may lie in this batch, in an earlier chunk, or in a radix-shared
prefix another request wrote. One int32 token id per slot (``KVCache.token_ids``), written with
every batch's tokens before the forward, makes them all one case: window slot s of a row is the
id stored at ``req_to_token[row, p - s]``, or the pad id before the request's first token.

Given that store the window is row-local, so each CP rank builds the windows of its own rows.
Text only: no position is dead (image tokens would be; dsv4cp serves text).
"""

from __future__ import annotations

import torch
from torch import Tensor


def store_token_ids(store: Tensor, slots: Tensor, input_ids: Tensor) -> None:
    """Write the raw token ids [T] of a batch at their slots [T] of the store [num_slots] (int32).
    Padding rows carry slot 0, the dummy slot, which nothing valid reads."""
    if store.dtype != torch.int32 or store.dim() != 1:
        raise ValueError(
            f"token id store must be int32 [num_slots], got {store.dtype} {store.shape}"
        )
    if slots.shape != input_ids.shape:
        raise ValueError(
            f"slots {tuple(slots.shape)} and input_ids {tuple(input_ids.shape)} must match"
        )
    store[slots] = input_ids.to(torch.int32)


def slot_windows(
    store: Tensor,
    req_to_token: Tensor,
    req_row: Tensor,
    positions: Tensor,
    valid: Tensor,
    *,
    token_map: Tensor,
    pad_id: int,
    max_ngram: int,
) -> Tensor:
    """int64 [P, N]: slot s of row i holds the compressed id of position positions[i] - s of its
    request (``token_map[store[req_to_token[req_row, p - s]]]``), ``pad_id`` before position 0 and
    on padding rows (valid False). Vectorised, no host sync."""
    if max_ngram < 1:
        raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
    back = torch.arange(max_ngram, device=positions.device)
    pos = positions[:, None] - back  # [P, N]
    inside = (pos >= 0) & valid[:, None]
    slots = req_to_token[req_row[:, None], pos.clamp(min=0)]
    raw = store[slots].long()
    ids = token_map[raw.clamp(0, token_map.shape[0] - 1)]
    return torch.where(inside, ids, pad_id)
