"""Engram n-gram hash ids: tokenizer-normalised compressed ids, then a multiplicative-XOR hash.

DeepSeek reference ``engram.py`` (``build_compressed_token_map``, ``compute_hash_multipliers``,
``EngramLayout.from_args``, ``NgramHashState.forward``), restated:

1. Compressed ids: every token id is decoded alone (special tokens kept), normalised (NFKC, NFD,
   strip accents, lowercase, whitespace runs → one space, strip — a token that is exactly one
   space stays one space); tokens with the same normal form share an id, numbered in order of
   first appearance. A decode holding U+FFFD (a partial UTF-8 byte token) is keyed by the raw
   token string instead; an empty normal form keys by the decoded text.
2. For the token at position p, n-gram slot s (s = 0…N-1, N = ``engram_max_ngram_size``) holds the
   compressed id at p - s. Slots before the request's start hold the pad id (the compressed id of
   ``engram_pad_token_id``); a dead token (-1: an image position) and every older slot also turn
   into the pad id, so an n-gram never crosses a request start or an image span.
3. Per Engram layer ℓ, with odd multipliers m[ℓ, s] (numpy PCG64 seeded 10007·layer_id, values in
   [0, (2⁶³-1) // V // 2) doubled plus one, V the compressed vocab size):
   h_n = XOR_{s<n} (id_s · m[ℓ, s]) for n = 2…N, and for every head j the row
   ``offset[ℓ, n, j] + h_n mod prime[ℓ, n, j]``. The primes are the smallest unused primes above
   ``engram_vocab_size - 1``, drawn in (layer, n, head) order and never reused; the offsets are the
   running sums of one layer's primes, so every (n, head) owns a disjoint range of its table.

The batched op takes per-request boundaries and the previous N-1 compressed ids of each request,
so a later prefill chunk hashes exactly as if the whole request had been one chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

DEAD = -1  # compressed id of a position that takes no part in any n-gram (image tokens)
_SENTINEL = "\ue000"  # private-use char: keeps a lone-space token from stripping to nothing
_HASH_SEED = 10007


def _normalizer() -> Any:
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


def compressed_token_map(tokenizer: Any) -> tuple[list[int], int]:
    """(lookup raw id → compressed id, compressed vocab size) for a ``tokenizers.Tokenizer``
    (or anything with ``backend_tokenizer``, e.g. a transformers fast tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    norm = _normalizer()
    ids: dict[str, int] = {}
    lookup = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = backend.id_to_token(token_id)
        else:
            key = norm.normalize_str(text) or text
        lookup.append(ids.setdefault(key, len(ids)))
    return lookup, len(ids)


def _is_prime(n: int) -> bool:
    if n < 4:
        return n >= 2
    if n % 2 == 0 or n % 3 == 0:
        return False
    f = 5
    while f * f <= n:
        if n % f == 0 or n % (f + 2) == 0:
            return False
        f += 6
    return True


def engram_primes(
    n_layers: int, *, max_ngram_size: int, n_heads: int, vocab_size: int
) -> list[list[list[int]]]:
    """[layer][n-gram size - 2][head] bucket moduli: fresh primes above vocab_size - 1."""
    used: set[int] = set()
    layers = []
    for _ in range(n_layers):
        per_n = []
        for _ in range(max_ngram_size - 1):
            heads, p = [], vocab_size - 1
            for _ in range(n_heads):
                p += 1
                while p in used or not _is_prime(p):
                    p += 1
                used.add(p)
                heads.append(p)
            per_n.append(heads)
        layers.append(per_n)
    return layers


def hash_multipliers(
    layer_ids: Sequence[int], *, max_ngram_size: int, compressed_vocab_size: int
) -> Tensor:
    """int64 [n_layers, N]: odd multipliers small enough that id · m never overflows int64."""
    bound = max(1, np.iinfo(np.int64).max // compressed_vocab_size // 2)
    rows = []
    for layer_id in layer_ids:
        rng = np.random.default_rng(_HASH_SEED * layer_id)
        rows.append(rng.integers(0, bound, size=(max_ngram_size,), dtype=np.int64) * 2 + 1)
    return torch.from_numpy(np.stack(rows))


def ngram_windows(
    compressed: Tensor, cu_seqlens: Tensor, history: Tensor, *, pad_id: int
) -> Tensor:
    """int64 [T, N]: slot s of token t holds the compressed id s positions back (pad / blocked).

    compressed [T] int64 (``DEAD`` for image positions), requests packed back to back with
    boundaries cu_seqlens [R+1]; history [R, N-1] the compressed ids before each request's first
    token here, oldest first (``pad_id`` where the request has no earlier token, ``DEAD`` for an
    image position).
    """
    t = compressed.shape[0]
    r, back = history.shape
    if cu_seqlens.shape != (r + 1,):
        raise ValueError(
            f"cu_seqlens must be [{r + 1}] for {r} history rows, got {tuple(cu_seqlens.shape)}"
        )
    device = compressed.device
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    lens = cu[1:] - cu[:-1]
    req = torch.repeat_interleave(torch.arange(r, device=device), lens, output_size=t)
    pos = torch.arange(t, device=device) - cu[:-1][req]  # position inside the request's chunk
    shift = torch.arange(back + 1, device=device)
    # source in [history (R·(N-1)) | compressed (T)]: in-chunk when pos >= s, else history
    inside = pos[:, None] >= shift
    chunk_idx = r * back + torch.arange(t, device=device)[:, None] - shift
    hist_idx = req[:, None] * back + back - (shift - pos[:, None])
    source = torch.cat([history.to(device=device, dtype=torch.int64).flatten(), compressed])
    window = source[torch.where(inside, chunk_idx, hist_idx.clamp_min(0))]
    blocked = torch.cummax((window == DEAD).to(torch.int8), dim=1).values.bool()
    return window.masked_fill(blocked, pad_id)


def ngram_hash_ids(
    windows: Tensor, *, multipliers: Tensor, primes: Tensor, offsets: Tensor
) -> Tensor:
    """int64 [T, n_layers, (N-1)·n_heads] table rows from the windows [T, N]."""
    products = windows[:, None, :] * multipliers.to(windows.device)  # [T, L, N]
    rolling = products[..., 0]
    cols = []
    primes = primes.to(windows.device)
    for n in range(1, windows.shape[1]):
        rolling = torch.bitwise_xor(rolling, products[..., n])
        cols.append(rolling[..., None] % primes[:, n - 1])  # [T, L, heads]
    return torch.cat(cols, dim=-1) + offsets.to(windows.device)


@dataclass(frozen=True)
class NgramHasher:
    """Everything the Engram hash needs, built once per model from the tokenizer and config."""

    token_map: Tensor  # int64 [tokenizer vocab]
    pad_id: int  # compressed id of engram_pad_token_id
    multipliers: Tensor  # int64 [n_layers, N]
    primes: Tensor  # int64 [n_layers, N-1, n_heads]
    offsets: Tensor  # int64 [n_layers, (N-1)·n_heads]
    layer_ids: tuple[int, ...]

    @property
    def max_ngram_size(self) -> int:
        return self.multipliers.shape[1]

    @classmethod
    def build(cls, config: Any, tokenizer: Any) -> NgramHasher:
        """From config fields ``engram_*`` (HF names) and the model's tokenizer."""
        lookup, size = compressed_token_map(tokenizer)
        if size != config.engram_compressed_vocab_size:
            raise ValueError(
                f"engram_compressed_vocab_size is {config.engram_compressed_vocab_size} but the "
                f"tokenizer normalises to {size} ids: every hash would change"
            )
        layer_ids = tuple(config.engram_layer_ids)
        n = config.engram_max_ngram_size
        if n < 2:
            raise ValueError(f"engram_max_ngram_size must be >= 2, got {n}")
        primes = torch.tensor(
            engram_primes(
                len(layer_ids),
                max_ngram_size=n,
                n_heads=config.engram_n_heads,
                vocab_size=config.engram_vocab_size,
            ),
            dtype=torch.int64,
        )
        flat = primes.flatten(1)
        offsets = torch.cumsum(flat, dim=1) - flat
        rows = flat.sum(dim=1).tolist()
        for layer, need, have in zip(layer_ids, rows, config.engram_num_embeddings):
            if need > have:
                raise ValueError(
                    f"engram_num_embeddings for layer {layer} is {have}, the hash "
                    f"buckets need {need} rows"
                )
        if not 0 <= config.engram_pad_token_id < len(lookup):
            raise ValueError(
                f"engram_pad_token_id {config.engram_pad_token_id} is outside the "
                f"tokenizer's {len(lookup)} ids"
            )
        return cls(
            token_map=torch.tensor(lookup, dtype=torch.int64),
            pad_id=lookup[config.engram_pad_token_id],
            multipliers=hash_multipliers(layer_ids, max_ngram_size=n, compressed_vocab_size=size),
            primes=primes,
            offsets=offsets,
            layer_ids=layer_ids,
        )

    def compress(self, input_ids: Tensor, token_mask: Tensor | None = None) -> Tensor:
        """Compressed ids (int64, input_ids' device); ``DEAD`` where token_mask is False."""
        ids = input_ids.long()
        n = self.token_map.shape[0]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
            raise ValueError(f"input_ids must lie in [0, {n}) (the tokenizer's ids) for Engram")
        out = self.token_map.to(ids.device)[ids]
        return out if token_mask is None else out.masked_fill(~token_mask, DEAD)

    def empty_history(self, n_requests: int, device: torch.device | str = "cpu") -> Tensor:
        """History rows for requests that start here: all pad."""
        return torch.full(
            (n_requests, self.max_ngram_size - 1), self.pad_id, dtype=torch.int64, device=device
        )

    def history_of(self, prefix: Tensor, token_mask: Tensor | None = None) -> Tensor:
        """One request's history row [N-1] from its earlier token ids (any length, maybe 0)."""
        back = self.max_ngram_size - 1
        tail = self.compress(
            prefix[-back:] if back else prefix[:0],
            None if token_mask is None else token_mask[-back:],
        )
        row = self.empty_history(1, prefix.device)[0]
        if tail.numel():
            row[back - tail.numel() :] = tail
        return row

    def hash(
        self,
        input_ids: Tensor,
        cu_seqlens: Tensor,
        *,
        history: Tensor | None = None,
        token_mask: Tensor | None = None,
    ) -> Tensor:
        """Table rows int64 [T, n_layers, (N-1)·n_heads] for packed requests input_ids [T]."""
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be packed [T], got {tuple(input_ids.shape)}")
        n_req = cu_seqlens.shape[0] - 1
        if history is None:
            history = self.empty_history(n_req, input_ids.device)
        elif history.shape != (n_req, self.max_ngram_size - 1):
            raise ValueError(
                f"history must be [{n_req}, {self.max_ngram_size - 1}], got {tuple(history.shape)}"
            )
        windows = ngram_windows(
            self.compress(input_ids, token_mask), cu_seqlens, history, pad_id=self.pad_id
        )
        return ngram_hash_ids(
            windows, multipliers=self.multipliers, primes=self.primes, offsets=self.offsets
        )
