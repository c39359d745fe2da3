"""`EngramHashes`: the Engram hash ids of a forward's local rows, from the slot token-id store.

Built once per model from `NgramHasher` (tokenizer + config); its tables live on the model's
device. Each forward first writes the batch's raw token ids at their slots (`write`, global rows:
every CP rank keeps its own replicated store), then hashes its own local rows (`local_ids`),
reading the up to N-1 earlier ids of each request through `req_to_token` — earlier chunks and
radix-shared prefixes included (`ops/engram_slots.py`). The hash is row-local given the store, so
CP splits it like every other row-local step.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dsv4cp.context import ForwardContext
from dsv4cp.ops.engram_hash import NgramHasher, ngram_hash_ids
from dsv4cp.ops.engram_slots import slot_windows, store_token_ids


class EngramHashes(nn.Module):
    """Device copies of a `NgramHasher`'s tables (buffers, so `.to(device)` moves them)."""

    token_map: Tensor
    multipliers: Tensor
    primes: Tensor
    offsets: Tensor

    def __init__(self, hasher: NgramHasher, vocab_size: int, device: torch.device | str) -> None:
        super().__init__()
        n_map = hasher.token_map.shape[0]
        if n_map > vocab_size:
            raise ValueError(
                f"Engram: the tokenizer has {n_map} ids, more than vocab_size={vocab_size}"
            )
        # Ids the tokenizer does not know (vocab padding) never come from text: they hash as pad.
        token_map = torch.full((vocab_size,), hasher.pad_id, dtype=torch.int64)
        token_map[:n_map] = hasher.token_map
        self.register_buffer("token_map", token_map.to(device), persistent=False)
        self.register_buffer("multipliers", hasher.multipliers.to(device), persistent=False)
        self.register_buffer("primes", hasher.primes.to(device), persistent=False)
        self.register_buffer("offsets", hasher.offsets.to(device), persistent=False)
        self.pad_id = hasher.pad_id
        self.layer_ids = hasher.layer_ids
        self.max_ngram = hasher.max_ngram_size

    def write(self, store: Tensor, ctx: ForwardContext, input_ids: Tensor) -> None:
        """Record the batch's token ids (global rows) at their slots before any layer reads."""
        store_token_ids(store, ctx.meta.tokens.slots, input_ids)

    def local_ids(self, store: Tensor, ctx: ForwardContext) -> Tensor:
        """int64 [P, n_layers, (N-1)·n_heads] table rows of this rank's local rows."""
        local = ctx.local
        windows = slot_windows(
            store,
            local.req_to_token,
            local.req_row,
            local.positions,
            local.valid,
            token_map=self.token_map,
            pad_id=self.pad_id,
            max_ngram=self.max_ngram,
        )
        return ngram_hash_ids(
            windows, multipliers=self.multipliers, primes=self.primes, offsets=self.offsets
        )
