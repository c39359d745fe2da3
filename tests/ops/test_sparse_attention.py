"""sparse_attention against a per-token, per-head loop (attention-math §4.6)."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4cp.ops import sparse_attention


def loop_attention(q, kv, indices, sink, scale) -> torch.Tensor:
    ql, kvl, sl = q.double().tolist(), kv.double().tolist(), sink.double().tolist()
    out = []
    for t, idx_row in enumerate(indices.tolist()):
        heads = []
        for h in range(len(ql[t])):
            keys = [kvl[i] for i in idx_row if i >= 0]  # duplicates count once each
            scores = [
                sum(a * b for a, b in zip(ql[t][h], key, strict=True)) * scale for key in keys
            ]
            m = max([*scores, sl[h]])
            probs = [math.exp(s - m) for s in scores]
            denom = sum(probs) + math.exp(sl[h] - m)
            heads.append(
                [
                    sum(p * key[c] for p, key in zip(probs, keys, strict=True)) / denom
                    for c in range(len(kvl[0]))
                ]
            )
        out.append(heads)
    return torch.tensor(out, dtype=torch.float64)


T, H, D, N = 5, 3, 16, 12
INDICES = [
    [0, 3, 3, 7, -1, -1],  # duplicate key, -1 pads
    [-1, -1, -1, -1, -1, -1],  # no valid key: output 0
    [11, 10, 9, 8, 7, 6],
    [5, -1, 5, -1, 5, 2],  # pads in the middle
    [1, 2, 3, 4, 0, 11],
]

CASES = [
    pytest.param(1.0, [0.3, -0.5, 1.2], D**-0.5, id="typical"),
    pytest.param(8.0, [0.0, 2.0, -1.0], 1.0, id="large-logits"),
    pytest.param(1.0, [20.0, 25.0, 30.0], D**-0.5, id="sink-dominant"),
    pytest.param(1.0, [-30.0, -40.0, -50.0], D**-0.5, id="sink-negligible"),
]


@pytest.mark.parametrize(("q_scale", "sink", "scale"), CASES)
def test_sparse_attention_matches_loop(q_scale: float, sink: list[float], scale: float) -> None:
    gen = torch.Generator().manual_seed(50)
    q = torch.randn(T, H, D, generator=gen) * q_scale
    kv = torch.randn(N, D, generator=gen)
    indices = torch.tensor(INDICES, dtype=torch.int32)
    sink_t = torch.tensor(sink, dtype=torch.float32)
    got = sparse_attention(q, kv, indices, sink_t, scale)
    assert got.dtype == torch.float32 and got.shape == (T, H, D)
    want = loop_attention(q, kv, indices, sink_t, scale)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[1], torch.zeros(H, D))


def test_sink_takes_mass_but_adds_no_value() -> None:
    q = torch.zeros(1, 2, 4)
    kv = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    indices = torch.tensor([[0]], dtype=torch.int32)
    # zero scores: weight 1 / (1 + e^sink)
    got = sparse_attention(q, kv, indices, torch.tensor([0.0, math.log(3.0)]), 1.0)
    torch.testing.assert_close(got[0, 0], kv[0] / 2)
    torch.testing.assert_close(got[0, 1], kv[0] / 4)


def test_single_key_and_no_sink() -> None:
    gen = torch.Generator().manual_seed(51)
    q = torch.randn(3, 2, 8, generator=gen)
    kv = torch.randn(4, 8, generator=gen)
    indices = torch.tensor([[2], [-1], [0]], dtype=torch.int32)
    sink = torch.full((2,), float("-inf"))
    got = sparse_attention(q, kv, indices, sink, 0.5)
    torch.testing.assert_close(got[0], kv[2].expand(2, 8))
    assert torch.equal(got[1], torch.zeros(2, 8))
    torch.testing.assert_close(got[2], kv[0].expand(2, 8))


def test_bf16_inputs_return_bf16() -> None:
    gen = torch.Generator().manual_seed(52)
    q = torch.randn(T, H, D, generator=gen).to(torch.bfloat16)
    kv = torch.randn(N, D, generator=gen).to(torch.bfloat16)
    indices = torch.tensor(INDICES, dtype=torch.int32)
    sink = torch.tensor([0.1, 0.2, 0.3])
    got = sparse_attention(q, kv, indices, sink, D**-0.5)
    assert got.dtype == torch.bfloat16
    want = loop_attention(q, kv, indices, sink, D**-0.5)
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)


def test_nan_propagates_instead_of_becoming_zero() -> None:
    torch.manual_seed(11)
    q, kv, sink = torch.randn(T, H, D), torch.randn(N, D), torch.tensor([0.3, -0.5, 1.2])
    idx = torch.tensor(INDICES)
    q[0, 1, 4] = float("nan")  # one head of token 0
    kv[6, 0] = float("nan")  # a key only token 2 sees
    out = sparse_attention(q, kv, idx, sink, D**-0.5)
    nan_heads = out.isnan().all(-1)
    want = torch.zeros(T, H, dtype=torch.bool)
    want[0, 1] = True
    want[2, :] = True
    assert torch.equal(nan_heads, want)
    assert torch.isfinite(out[~want]).all()  # and no partly-NaN head
    clean = ~want
    ref = loop_attention(q, kv, idx, sink, D**-0.5)
    assert torch.allclose(out[clean].double(), ref[clean], atol=1e-6)
    # a NaN sink reaches every token of its head; the no-key row 1 included
    out = sparse_attention(q, kv.nan_to_num(), idx, torch.tensor([0.3, float("nan"), 1.2]), 1.0)
    assert out[:, 1].isnan().all() and torch.isfinite(out[1:, 2]).all()


def test_no_key_and_no_sink_gives_zero() -> None:
    q, kv = torch.randn(T, H, D), torch.randn(N, D)
    sink = torch.full((H,), float("-inf"))
    out = sparse_attention(q, kv, torch.tensor(INDICES), sink, D**-0.5)
    assert torch.equal(out[1], torch.zeros(H, D))  # row 1 has no valid index
    assert torch.isfinite(out).all()
