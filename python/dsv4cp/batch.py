"""A prefill (extend) batch and the per-token metadata attention reads.

Tokens are flattened request-major. Every per-token field is a device tensor so that the
quantities attention needs (visible counts, window slots, emission slots, pair partners) are
derived on the device, without host syncs, from five inputs: position, request row in
`req_to_token`, the request's start (cached prefix length) and end (prefix + new tokens), and the
token's write slot. Slot 0 is the dummy slot: padding rows read and write it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class RequestSlice:
    """New tokens of one request appended after `start` cached tokens."""

    rid: object
    req_row: int
    start: int
    token_ids: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class PrefillBatch:
    requests: tuple[RequestSlice, ...]

    def __post_init__(self) -> None:
        """The one check of a batch's shape (the runner checks token ids against the vocab)."""
        if not self.requests:
            raise ValueError("PrefillBatch: empty batch (no requests)")
        rids: set[object] = set()
        rows: set[int] = set()
        for r in self.requests:
            if not r.token_ids:
                raise ValueError(f"PrefillBatch: request {r.rid!r} has no new tokens")
            if r.rid in rids or r.req_row in rows:
                raise ValueError(f"PrefillBatch: request {r.rid!r} appears twice in one batch")
            rids.add(r.rid)
            rows.add(r.req_row)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    def input_ids(self, device: torch.device | str) -> Tensor:
        ids = [t for r in self.requests for t in r.token_ids]
        return torch.tensor(ids, dtype=torch.long, device=device)

    def last_token_rows(self) -> list[int]:
        out, n = [], 0
        for r in self.requests:
            n += len(r.token_ids)
            out.append(n - 1)
        return out


# The values a padding row carries (position 0, dummy slot 0, a request "ending" at 1); `valid`
# is False. Shared by CP padding (`TokenMeta.take`) and graph-bucket padding (`StaticBatch`).
PAD_ROW = {"positions": 0, "req_row": 0, "start": 0, "end": 1, "slots": 0, "batch_index": 0}


@dataclass
class TokenMeta:
    """Per-token metadata rows (global token order, or one CP rank's local rows)."""

    positions: Tensor  # int64 [T]
    req_row: Tensor  # int64 [T] row of req_to_token
    start: Tensor  # int64 [T] cached prefix length of the token's request
    end: Tensor  # int64 [T] prefix + new tokens of the token's request
    slots: Tensor  # int64 [T] write slot (0 = dummy for padding)
    batch_index: Tensor  # int64 [T] request index in the batch
    valid: Tensor  # bool [T] False on padding rows
    req_to_token: Tensor  # int64 [max_requests, max_context] position -> slot

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])

    def take(self, index: Tensor) -> TokenMeta:
        """Rows `index` (−1 = padding row: position 0, dummy slot, invalid)."""
        pad = index < 0
        safe = index.clamp(min=0)

        def pick(name: str) -> Tensor:
            x = getattr(self, name)[safe]
            return torch.where(pad, torch.full_like(x, PAD_ROW[name]), x)

        return TokenMeta(
            **{name: pick(name) for name in PAD_ROW},
            valid=self.valid[safe] & ~pad,
            req_to_token=self.req_to_token,
        )

    # -------------------------------------------------------------- derived, on device
    def n_visible(self, ratio: int) -> Tensor:
        """Compressed entries a query sees: ⌊(p+1)/r⌋ (0 on padding rows)."""
        return torch.where(self.valid, (self.positions + 1) // ratio, 0)

    def slot_of(self, positions: Tensor) -> Tensor:
        """Slot of position(s) of each row's request; positions [T] or [T, K]."""
        rows = self.req_row if positions.dim() == 1 else self.req_row[:, None]
        return self.req_to_token[rows, positions.clamp(min=0)]

    def entry_slots(self, ratio: int, entries: Tensor) -> Tensor:
        """Slot holding compressed entry j (stored at its block's last token), −1 for j < 0."""
        pos = (entries.long() + 1) * ratio - 1
        return torch.where(entries >= 0, self.slot_of(pos), -1)

    def emit_slots(self, ratio: int) -> Tensor:
        """Rows that complete a block write entry ⌊(p+1)/r⌋−1 at their own slot; others −1."""
        emits = ((self.positions + 1) % ratio == 0) & self.valid
        return torch.where(emits, self.slots, -1)

    def entry_positions(self, ratio: int) -> Tensor:
        """RoPE position of the entry a row emits: the first token of its block."""
        return ((self.positions + 1) // ratio - 1).clamp(min=0) * ratio

    def pair_partner_from_state(self) -> Tensor:
        """Ratio 2: the even partner of the first new (odd) token is in the pair state."""
        return self.positions == self.start

    def pair_state_read_slots(self) -> Tensor:
        return torch.where(self.pair_partner_from_state(), self.slot_of(self.positions - 1), 0)

    def pair_state_write_slots(self) -> Tensor:
        """Every even token keeps its fp32 kv/gate at its slot: a later chunk, or another
        request sharing a radix-cache prefix of odd length, may start at its odd partner."""
        even = (self.positions % 2 == 0) & self.valid
        return torch.where(even, self.slots, 0)


@dataclass
class CompressedWorkspace:
    """Per ratio: every request's compressed entries 0..⌊S/r⌋−1, concatenated request-major."""

    ratio: int
    slots: Tensor  # int64 [N] slot of each entry
    request_offset: Tensor  # int64 [R] first workspace row of each request
    max_entries: int  # largest ⌊S/r⌋ in the batch (the logits width)
    # the new tokens' mean visible entries ⌊(p+1)/r⌋ (host; None: a graph bucket's static one)
    mean_visible: float | None = None


@dataclass
class BatchMetadata:
    batch: PrefillBatch | None  # None for a graph bucket's static metadata
    tokens: TokenMeta  # global rows, length T
    workspaces: dict[int, CompressedWorkspace] = field(default_factory=dict)

    def workspace_start(self, ratio: int, tokens: TokenMeta) -> Tensor:
        ws = self.workspaces[ratio]
        return torch.where(tokens.valid, ws.request_offset[tokens.batch_index], 0)


def build_metadata(
    batch: PrefillBatch,
    req_to_token: Tensor,
    slots: Sequence[int] | Tensor,
    ratios: Sequence[int],
) -> BatchMetadata:
    """Metadata for `batch`; `slots` are the write slots of its tokens in flattened order."""
    device = req_to_token.device
    pos, row, start, end, bidx = [], [], [], [], []
    for b, r in enumerate(batch.requests):
        n = len(r.token_ids)
        pos.append(torch.arange(r.start, r.end))
        row.append(torch.full((n,), r.req_row))
        start.append(torch.full((n,), r.start))
        end.append(torch.full((n,), r.end))
        bidx.append(torch.full((n,), b))
    slots_t = torch.as_tensor(slots, dtype=torch.long)
    if slots_t.numel() != batch.num_tokens:
        raise ValueError(f"build_metadata: {slots_t.numel()} slots for {batch.num_tokens} tokens")
    tokens = TokenMeta(
        positions=torch.cat(pos).to(device),
        req_row=torch.cat(row).to(device),
        start=torch.cat(start).to(device),
        end=torch.cat(end).to(device),
        slots=slots_t.to(device),
        batch_index=torch.cat(bidx).to(device),
        valid=torch.ones(batch.num_tokens, dtype=torch.bool, device=device),
        req_to_token=req_to_token,
    )
    meta = BatchMetadata(batch=batch, tokens=tokens)
    for ratio in sorted({r for r in ratios if r > 0}):
        meta.workspaces[ratio] = _workspace(batch, req_to_token, ratio)
    return meta


def _workspace(batch: PrefillBatch, req_to_token: Tensor, ratio: int) -> CompressedWorkspace:
    counts = [r.end // ratio for r in batch.requests]
    offsets = [0]
    for c in counts[:-1]:
        offsets.append(offsets[-1] + c)
    rows = torch.cat([torch.full((c,), r.req_row) for c, r in zip(counts, batch.requests)])
    last_pos = torch.cat([(torch.arange(c) + 1) * ratio - 1 for c in counts])
    device = req_to_token.device
    slots = req_to_token[rows.to(device), last_pos.to(device)]
    seen = sum(
        visible_entries(r.end, ratio) - visible_entries(r.start, ratio) for r in batch.requests
    )
    return CompressedWorkspace(
        ratio=ratio,
        slots=slots,
        request_offset=torch.tensor(offsets, dtype=torch.long, device=device),
        max_entries=max(counts),
        mean_visible=seen / max(batch.num_tokens, 1),
    )


def visible_entries(n: int, ratio: int) -> int:
    """Σ over positions p < n of ⌊(p+1)/ratio⌋, the entries each sees (closed form: m = ⌊n/r⌋
    full groups of r positions seeing 0…m−1, then n − m·r + 1 positions seeing m)."""
    m = n // ratio
    return ratio * m * (m - 1) // 2 + m * (n - m * ratio + 1)
