"""Engram: the compressed token map, the n-gram hash (boundaries, chunks, image tokens), host
table lookups that move only the looked-up rows, and the gated stream update."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from torch import Tensor

from dsv4cp.layers.engram import TABLE_NAMES, Engram
from dsv4cp.ops.engram import engram_gate_update, gather_table_rows, lookup_fp8_rows
from dsv4cp.ops.engram_hash import (
    DEAD,
    NgramHasher,
    compressed_token_map,
    engram_primes,
    hash_multipliers,
)
from tests.model import dsv41_fixture as fx

N = 4  # engram_max_ngram_size of the fixture


@pytest.fixture(scope="module")
def hasher() -> NgramHasher:
    return NgramHasher.build(fx.text_config(), Tokenizer.from_file(str(fx.TOKENIZER)))


def test_fixture_tokenizer_compresses_case_and_leading_space(hasher: NgramHasher) -> None:
    tok = Tokenizer.from_file(str(fx.TOKENIZER))
    lookup, size = compressed_token_map(tok)
    assert size == fx.text_config().engram_compressed_vocab_size
    for n in range(5):
        variants = [f"tok{n}", f" tok{n}", f"TOK{n}", f" Tok{n}"]
        assert len({lookup[tok.token_to_id(v)] for v in variants}) == 1
    assert len({lookup[0], lookup[1], lookup[2], lookup[tok.token_to_id("tok0")]}) == 4
    assert hasher.pad_id == lookup[fx.text_config().engram_pad_token_id]


def test_normalisation_rules() -> None:
    tokens = [
        "<unk>",
        " ",
        "  ",
        "\t\n",
        "Café",
        "cafe",
        "CAFE",
        "\ufb01",
        "fi",
        "\ufffdx",
        "\ufffdX",
    ]
    tok = Tokenizer(WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    lookup, size = compressed_token_map(tok)
    ids = dict(zip(tokens, lookup))
    assert ids[" "] == ids["  "] == ids["\t\n"] != ids["<unk>"]  # a lone space survives
    assert ids["Café"] == ids["cafe"] == ids["CAFE"]  # accents and case
    assert ids["\ufb01"] == ids["fi"]  # NFKC
    assert ids["\ufffdx"] != ids["\ufffdX"]  # partial-UTF-8 tokens keep their raw form
    first_seen = list(dict.fromkeys(lookup))
    assert first_seen == list(range(size))  # numbered in order of first appearance


def _sieve_primes_above(start: int, count: int) -> list[int]:
    hi = start + 64 * count + 64
    flags = np.ones(hi + 1, dtype=bool)
    flags[:2] = False
    for p in range(2, math.isqrt(hi) + 1):
        if flags[p]:
            flags[p * p :: p] = False
    return [int(p) for p in np.nonzero(flags)[0] if p > start][:count]


def test_primes_are_fresh_and_in_draw_order() -> None:
    primes = engram_primes(2, max_ngram_size=N, n_heads=2, vocab_size=100)
    assert sum(sum(primes, []), []) == _sieve_primes_above(99, 2 * 3 * 2)


def test_multipliers_are_odd_and_cannot_overflow() -> None:
    v = 99092  # the release's compressed vocab
    m = hash_multipliers([1, 14], max_ngram_size=N, compressed_vocab_size=v)
    assert m.shape == (2, N) and (m % 2 == 1).all()
    assert (m.max().item()) * (v - 1) < 2**63
    assert not torch.equal(m[0], m[1])
    assert torch.equal(m, hash_multipliers([1, 14], max_ngram_size=N, compressed_vocab_size=v))


def naive_hash(h: NgramHasher, comp: list[int], history: list[int]) -> list[list[list[int]]]:
    """One request in Python ints: slots back in time, blocked at the first dead slot."""
    seq = history + comp
    out = []
    for p in range(len(history), len(seq)):
        window, dead = [], False
        for s in range(N):
            v = seq[p - s] if p - s >= 0 else h.pad_id
            dead = dead or v == DEAD
            window.append(h.pad_id if dead else v)
        per_layer = []
        for layer in range(len(h.layer_ids)):
            m = h.multipliers[layer].tolist()
            rolling, cols = window[0] * m[0], []
            for n in range(1, N):
                rolling ^= window[n] * m[n]
                cols += [rolling % int(p_) for p_ in h.primes[layer, n - 1]]
            per_layer.append([c + int(o) for c, o in zip(cols, h.offsets[layer])])
        out.append(per_layer)
    return out


def _ids(n: int, seed: int) -> Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def test_hash_matches_python_ints_and_stays_in_each_bucket(hasher: NgramHasher) -> None:
    ids = _ids(40, 1)
    mask = torch.ones(40, dtype=torch.bool)
    mask[[7, 20, 21]] = False
    got = hasher.hash(ids, torch.tensor([0, 40]), token_mask=mask)
    comp = hasher.compress(ids, mask).tolist()
    pad = [hasher.pad_id] * (N - 1)
    assert got.tolist() == naive_hash(hasher, comp, pad)
    lo = hasher.offsets
    hi = lo + hasher.primes.flatten(1)
    assert ((got >= lo) & (got < hi)).all()


def test_first_positions_hash_with_pad(hasher: NgramHasher) -> None:
    ids = _ids(5, 2)
    comp = hasher.compress(ids).tolist()
    alone = hasher.hash(ids[:1], torch.tensor([0, 1]))
    assert alone.tolist() == naive_hash(hasher, comp[:1], [hasher.pad_id] * 3)
    explicit_pad = torch.full((1,), fx.text_config().engram_pad_token_id)
    # a request that starts here hashes like one preceded by pad tokens
    with_pads = hasher.hash(torch.cat([explicit_pad.repeat(3), ids]), torch.tensor([0, 8]))
    assert torch.equal(hasher.hash(ids, torch.tensor([0, 5])), with_pads[3:])


def test_ngrams_do_not_cross_request_boundaries(hasher: NgramHasher) -> None:
    reqs = [_ids(9, 3), _ids(2, 4), _ids(13, 5)]
    packed = hasher.hash(torch.cat(reqs), torch.tensor([0, 9, 11, 24]))
    alone = torch.cat([hasher.hash(r, torch.tensor([0, r.numel()])) for r in reqs])
    assert torch.equal(packed, alone)


@pytest.mark.parametrize("cuts", [(1,), (2, 3), (5, 6, 7, 20)])
def test_chunks_with_history_equal_one_chunk(hasher: NgramHasher, cuts: tuple[int, ...]) -> None:
    ids = _ids(30, 6)
    mask = torch.ones(30, dtype=torch.bool)
    mask[4] = False  # an image position inside the history of later chunks
    whole = hasher.hash(ids, torch.tensor([0, 30]), token_mask=mask)
    bounds = [0, *cuts, 30]
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        history = hasher.history_of(ids[:a], mask[:a])[None]
        cu = torch.tensor([0, b - a])
        parts.append(hasher.hash(ids[a:b], cu, history=history, token_mask=mask[a:b]))
    assert torch.equal(torch.cat(parts), whole)


def test_batched_chunks_take_per_request_history(hasher: NgramHasher) -> None:
    a, b = _ids(12, 7), _ids(6, 8)
    history = torch.stack([hasher.history_of(a[:5]), hasher.history_of(b[:1])])
    got = hasher.hash(torch.cat([a[5:], b[1:]]), torch.tensor([0, 7, 12]), history=history)
    want_a = hasher.hash(a, torch.tensor([0, 12]))[5:]
    want_b = hasher.hash(b, torch.tensor([0, 6]))[1:]
    assert torch.equal(got, torch.cat([want_a, want_b]))


def test_hash_rejects_bad_input(hasher: NgramHasher) -> None:
    with pytest.raises(ValueError, match="input_ids must lie"):
        hasher.hash(torch.tensor([0, 999]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="history must be"):
        hasher.hash(_ids(3, 9), torch.tensor([0, 3]), history=torch.zeros(1, 2, dtype=torch.long))
    cfg = fx.text_config()
    tok = Tokenizer.from_file(str(fx.TOKENIZER))
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        NgramHasher.build(SimpleNamespace(**{**vars(cfg), "engram_compressed_vocab_size": 66}), tok)
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        NgramHasher.build(
            SimpleNamespace(**{**vars(cfg), "engram_num_embeddings": [659, 864]}), tok
        )


class RecordingRows:
    """A numpy row source that records which rows were read."""

    def __init__(self, array: np.ndarray) -> None:
        self.array, self.reads = array, []

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    def __getitem__(self, rows: np.ndarray) -> np.ndarray:
        self.reads.append(np.asarray(rows).tolist())
        return self.array[rows]


def _table(rows: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(rows, 64, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.randint(110, 135, (rows, 2), dtype=torch.uint8, generator=g).view(
        torch.float8_e8m0fnu
    )
    return codes, scale


def test_lookup_reads_and_moves_only_distinct_rows(tmp_path) -> None:
    codes, scale = _table(50, 10)
    path = tmp_path / "table.bin"
    codes.view(torch.uint8).numpy().tofile(path)
    source = RecordingRows(np.memmap(path, dtype=np.uint8, mode="r", shape=(50, 64)))
    ids = torch.tensor([[7, 3, 7], [49, 3, 0]])
    rows, inverse = gather_table_rows(source, ids, device="cpu", dtype=torch.float8_e4m3fn)
    assert source.reads == [[0, 3, 7, 49]] and rows.shape == (4, 64)
    assert torch.equal(rows[inverse].view(torch.uint8), codes[ids].view(torch.uint8))
    from_tensor, _ = gather_table_rows(codes, ids, device="cpu")
    assert torch.equal(from_tensor.view(torch.uint8), rows.view(torch.uint8))
    with pytest.raises(ValueError, match="table ids must lie"):
        gather_table_rows(codes, torch.tensor([50]), device="cpu")


def test_lookup_dequantizes_with_the_row_scales() -> None:
    codes, scale = _table(20, 11)
    ids = torch.tensor([[1, 19], [4, 4]])
    got = lookup_fp8_rows(codes, scale, ids, device="cpu", out_dtype=torch.float32)
    full = codes.float() * scale.float().repeat_interleave(32, dim=1)
    assert torch.equal(got, full[ids])
    bf16 = lookup_fp8_rows(codes, scale, ids, device="cpu", out_dtype=torch.bfloat16)
    assert torch.equal(bf16.float(), got)  # e4m3 · 2^k is exact in bf16


def test_fixture_table_through_a_shard_memmap() -> None:
    name = "layers.1.engram.embed.weight"
    view = fx.shard_memmap(name)
    assert isinstance(view, np.memmap)
    assert torch.equal(torch.from_numpy(np.array(view)), fx.tensor(name).view(torch.uint8))


def naive_gate_update(x: Tensor, kv: Tensor, qw: Tensor, kw: Tensor, eps: float) -> Tensor:
    t, hc, d = x.shape
    out = x.double().clone()
    for i in range(t):
        value = kv[i, hc * d :].double()
        for j in range(hc):
            h, key = x[i, j].double(), kv[i, j * d : (j + 1) * d].double()
            dot = (h * qw[j].double() * kw[j].double() * key).sum()
            dot = (
                dot
                / math.sqrt((h * h).mean() + eps)
                / math.sqrt((key * key).mean() + eps)
                / math.sqrt(d)
            )
            signed = math.copysign(math.sqrt(max(abs(dot.item()), 1e-6)), dot.item())
            out[i, j] += value / (1 + math.exp(-signed))
    return out


def test_gate_update_matches_fp64_and_masks_tokens() -> None:
    g = torch.Generator().manual_seed(12)
    x, kv = torch.randn(6, 4, 32, generator=g), torch.randn(6, 5 * 32, generator=g)
    qw, kw = torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g)
    got = engram_gate_update(x, kv, qw, kw, norm_eps=1e-20)
    torch.testing.assert_close(
        got.double(), naive_gate_update(x, kv, qw, kw, 1e-20), rtol=1e-5, atol=1e-5
    )
    mask = torch.tensor([True, False, True, True, False, True])
    masked = engram_gate_update(x, kv, qw, kw, norm_eps=1e-20, token_mask=mask)
    assert torch.equal(masked[~mask], x[~mask]) and torch.equal(masked[mask], got[mask])
    with pytest.raises(ValueError, match="kv must be"):
        engram_gate_update(x, kv[:, :-1], qw, kw, norm_eps=1e-20)


def test_layer_slots_and_table_checks() -> None:
    cfg = fx.text_config()
    layer = Engram(cfg, 1, dtype=torch.bfloat16, device="cpu")
    slots = layer.checkpoint_slots("layers.1.engram.")
    in_ckpt = {n for n in fx.names() if n.startswith("layers.1.engram.")}
    assert set(slots) == in_ckpt - {f"layers.1.engram.{n}" for n in TABLE_NAMES}
    fx.load_slots(slots)
    x, ids = torch.zeros(2, 4, 128, dtype=torch.bfloat16), torch.zeros(2, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="no table"):
        layer(x, ids)
    with pytest.raises(ValueError, match="table must be"):
        layer.attach_table(*_table(660, 0))  # layer 0's size
    with pytest.raises(ValueError, match="not in engram_layer_ids"):
        Engram(cfg, 2, dtype=torch.bfloat16, device="cpu")
