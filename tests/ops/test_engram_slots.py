"""n-gram windows read through token slots (`ops/engram_slots.py`) equal the packed windows with
explicit history (`ops/engram_hash.ngram_windows`): chunks, several requests, and a request whose
prefix slots another request wrote (a radix-shared prefix)."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.ops.engram_hash import ngram_windows
from dsv4cp.ops.engram_slots import slot_windows, store_token_ids

N, PAD = 4, 7
VOCAB = 50


def _map() -> torch.Tensor:
    return torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0)) + 100


def _history(compressed: list[int], start: int) -> list[int]:
    before = compressed[max(0, start - (N - 1)) : start]
    return [PAD] * (N - 1 - len(before)) + before


@pytest.mark.parametrize("starts", [(0, 0), (5, 0), (1, 2), (3, 9)])
def test_slot_windows_equal_packed_windows_with_history(starts: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(sum(starts))
    token_map = _map()
    lens, new = (12, 15), (6, 5)  # request lengths, tokens in this batch (the last ones)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in lens]
    num_slots = 64
    store = torch.zeros(num_slots, dtype=torch.int32)
    req_to_token = torch.zeros(2, 32, dtype=torch.long)
    free = iter(torch.randperm(num_slots - 1, generator=g).add(1).tolist())  # slot 0: dummy
    for r, p in enumerate(prompts):
        for pos in range(len(p)):
            req_to_token[r, pos] = next(free)
    # earlier chunks were written by earlier forwards; this batch writes its own tokens
    rows, positions = [], []
    for r, (p, n) in enumerate(zip(prompts, new)):
        start = len(p) - n
        store_token_ids(store, req_to_token[r, :start], p[:start])
        rows += [r] * n
        positions += list(range(start, len(p)))
    batch_ids = torch.cat([p[len(p) - n :] for p, n in zip(prompts, new)])
    slots = req_to_token[torch.tensor(rows), torch.tensor(positions)]
    store_token_ids(store, slots, batch_ids)
    got = slot_windows(
        store,
        req_to_token,
        torch.tensor(rows),
        torch.tensor(positions),
        torch.ones(len(rows), dtype=torch.bool),
        token_map=token_map,
        pad_id=PAD,
        max_ngram=N,
    )
    compressed = [token_map[p].tolist() for p in prompts]
    history = torch.tensor(
        [_history(c, len(c) - n) for c, n in zip(compressed, new)], dtype=torch.int64
    )
    cu = torch.tensor([0, new[0], new[0] + new[1]])
    want = ngram_windows(token_map[batch_ids], cu, history, pad_id=PAD)
    assert torch.equal(got, want)


def test_shared_prefix_written_by_another_request() -> None:
    """Request b's positions 0..4 point at slots request a wrote: b's windows read a's tokens."""
    token_map = _map()
    store = torch.zeros(16, dtype=torch.int32)
    req_to_token = torch.zeros(2, 8, dtype=torch.long)
    a = torch.tensor([3, 1, 4, 1, 5])
    req_to_token[0, :5] = torch.arange(1, 6)
    store_token_ids(store, req_to_token[0, :5], a)
    req_to_token[1, :5] = req_to_token[0, :5]  # shared prefix
    req_to_token[1, 5] = 9
    store_token_ids(store, torch.tensor([9]), torch.tensor([2]))
    got = slot_windows(
        store,
        req_to_token,
        torch.tensor([1]),
        torch.tensor([5]),
        torch.tensor([True]),
        token_map=token_map,
        pad_id=PAD,
        max_ngram=N,
    )
    assert got.tolist() == [token_map[[2, 5, 1, 4]].tolist()]


def test_padding_rows_and_early_positions_read_pad() -> None:
    token_map = _map()
    store = torch.arange(16, dtype=torch.int32)
    req_to_token = torch.arange(16).view(1, 16)
    got = slot_windows(
        store,
        req_to_token,
        torch.tensor([0, 0]),
        torch.tensor([1, 9]),
        torch.tensor([True, False]),
        token_map=token_map,
        pad_id=PAD,
        max_ngram=N,
    )
    assert got[0].tolist() == [int(token_map[1]), int(token_map[0]), PAD, PAD]
    assert got[1].tolist() == [PAD] * N


def test_store_checks_its_inputs() -> None:
    with pytest.raises(ValueError, match="int32"):
        store_token_ids(torch.zeros(4), torch.tensor([1]), torch.tensor([2]))
    with pytest.raises(ValueError, match="must match"):
        store_token_ids(torch.zeros(4, dtype=torch.int32), torch.tensor([1, 2]), torch.tensor([2]))
