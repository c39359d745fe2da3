"""Indexer ops against per-token / per-head loops (attention-math §5.3)."""

from __future__ import annotations

import cmath
import math

import pytest
import torch

from dsv4cp.ops import (
    YarnScaling,
    candidate_blocks,
    indexer_weights,
    mqa_logits,
    rope_index_queries,
    topk_among_blocks,
    topk_indices,
)

YARN = YarnScaling(factor=16.0, original_max_position=65536, beta_fast=32.0, beta_slow=1.0)
THETA, DR = 160000.0, 32
NEG_INF = float("-inf")


def loop_omega() -> list[float]:
    def corr(n: float) -> float:
        ratio = YARN.original_max_position / (2 * math.pi * n)
        return DR * math.log(ratio) / (2 * math.log(THETA))

    lo = max(math.floor(corr(YARN.beta_fast)), 0)
    hi = min(math.ceil(corr(YARN.beta_slow)), DR - 1)
    out = []
    for i in range(DR // 2):
        w0 = THETA ** (-2.0 * i / DR)
        ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)
        out.append(w0 / YARN.factor * ramp + w0 * (1.0 - ramp))
    return out


# ---------------------------------------------------------------- queries and weights


@pytest.mark.parametrize(("n_heads", "head_dim"), [(4, 64), (2, 32)], ids=["H4-D64", "H2-D32"])
def test_index_queries_match_loop(n_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(40)
    q_lora = torch.randn(5, 24, generator=gen)
    wq_b = torch.randn(n_heads * head_dim, 24, generator=gen) / 5
    positions = [0, 3, 8, 21, 50]
    pos = torch.tensor(positions)
    got = rope_index_queries(q_lora @ wq_b.t(), pos, DR, THETA, YARN, head_dim=head_dim)
    assert got.shape == (5, n_heads, head_dim) and got.dtype == torch.float32
    omega, w = loop_omega(), wq_b.double().tolist()
    want = []
    for t, pos in enumerate(positions):
        row = q_lora[t].double().tolist()
        heads = []
        for h in range(n_heads):
            v = [
                sum(a * b for a, b in zip(row, w[h * head_dim + i], strict=True))
                for i in range(head_dim)
            ]
            base = head_dim - DR
            for i, om in enumerate(omega):
                z = complex(v[base + 2 * i], v[base + 2 * i + 1]) * cmath.exp(1j * pos * om)
                v[base + 2 * i], v[base + 2 * i + 1] = z.real, z.imag
            heads.append(v)
        want.append(heads)
    torch.testing.assert_close(got.double(), torch.tensor(want).double(), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(
    ("n_heads", "head_dim", "scale"),
    [(4, 64, 1 / 16), (32, 128, 1 / 64)],
    ids=["tiny-H4-D64", "real-H32-D128"],
)
def test_indexer_weights_match_loop(n_heads: int, head_dim: int, scale: float) -> None:
    gen = torch.Generator().manual_seed(41)
    x = torch.randn(3, 40, generator=gen)
    proj = torch.randn(n_heads, 40, generator=gen)
    got = indexer_weights(x, proj, head_dim=head_dim)
    assert got.dtype == torch.float32 and got.shape == (3, n_heads)
    assert scale == pytest.approx(head_dim**-0.5 * n_heads**-0.5)
    want = [
        [sum(a * b for a, b in zip(xr, pr, strict=True)) * scale for pr in proj.double().tolist()]
        for xr in x.double().tolist()
    ]
    torch.testing.assert_close(got.double(), torch.tensor(want).double(), rtol=1e-5, atol=1e-6)


def test_indexer_weights_round_projection_to_input_dtype() -> None:
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(3, 40, generator=gen).to(torch.bfloat16)
    proj = torch.randn(4, 40, generator=gen).to(torch.bfloat16)
    got = indexer_weights(x, proj, head_dim=64)
    assert got.dtype == torch.float32
    raw = got / (1 / 16)
    assert torch.equal(raw, raw.to(torch.bfloat16).float())  # bf16 values before scaling


# ---------------------------------------------------------------- mqa_logits


def loop_mqa_logits(q, weights, k, n_visible, k_start, width) -> list[list[float]]:
    ql, wl, kl = q.double().tolist(), weights.double().tolist(), k.double().tolist()
    out = []
    for t in range(len(ql)):
        row = []
        for j in range(width):
            if j >= n_visible[t]:
                row.append(NEG_INF)
                continue
            key = kl[k_start[t] + j]
            row.append(
                sum(
                    wl[t][h] * max(0.0, sum(a * b for a, b in zip(ql[t][h], key, strict=True)))
                    for h in range(len(ql[t]))
                )
            )
        out.append(row)
    return out


def _mqa_inputs(seed: int, t: int, n: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, 4, 16, generator=gen)
    weights = torch.randn(t, 4, generator=gen)  # negative weights too
    k = torch.randn(n, 16, generator=gen)
    return q, weights, k


MQA_CASES = [
    pytest.param([0, 1, 3, 5, 10, 7], None, None, id="causal-n0-to-N"),
    pytest.param([0, 5, 3, 5, 2, 1], [0, 2, 4, 1, 0, 3], 5, id="k_start-and-width"),
    pytest.param([2, 10, 0, 4, 9, 6], None, 13, id="width-beyond-N"),
    pytest.param([1, 2, 3, 0, 2, 1], [9, 8, 7, 0, 3, 9], 3, id="k_start-near-end"),
]


@pytest.mark.parametrize(("n_visible", "k_start", "width"), MQA_CASES)
def test_mqa_logits_match_loop(
    n_visible: list[int], k_start: list[int] | None, width: int | None
) -> None:
    q, weights, k = _mqa_inputs(43, 6, 10)
    got = mqa_logits(
        q,
        weights,
        k,
        torch.tensor(n_visible, dtype=torch.int32),
        k_start=None if k_start is None else torch.tensor(k_start),
        width=width,
    )
    w = 10 if width is None else width
    assert got.dtype == torch.float32 and got.shape == (6, w)
    want = torch.tensor(loop_mqa_logits(q, weights, k, n_visible, k_start or [0] * 6, w))
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite].double(), want[finite].double(), rtol=1e-5, atol=1e-6)


def test_mqa_logits_rows_are_independent() -> None:
    q, weights, k = _mqa_inputs(44, 7, 12)
    n = torch.tensor([0, 12, 3, 7, 12, 1, 5])
    start = torch.tensor([0, 0, 2, 1, 0, 11, 4])
    full = mqa_logits(q, weights, k, n, k_start=start, width=8)
    parts = [
        mqa_logits(q[a:b], weights[a:b], k, n[a:b], k_start=start[a:b], width=8)
        for a, b in [(0, 2), (2, 3), (3, 7)]
    ]
    torch.testing.assert_close(torch.cat(parts), full, rtol=1e-6, atol=1e-7)
    assert torch.equal(
        mqa_logits(q, weights, k, n), mqa_logits(q, weights, k, n, k_start=torch.zeros(7), width=12)
    )


def test_mqa_logits_bf16_inputs_upcast() -> None:
    q, weights, k = _mqa_inputs(45, 3, 5)
    q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    got = mqa_logits(q, weights, k, torch.tensor([5, 2, 0]))
    assert got.dtype == torch.float32
    want = torch.tensor(loop_mqa_logits(q, weights, k, [5, 2, 0], [0] * 3, 5))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite].double(), want[finite].double(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- top-k


def loop_topk(row: list[float], n: int, k: int) -> list[int]:
    n = min(n, len(row))
    picks = list(range(n))
    if n > k:  # exact ties go to the smaller index
        picks = sorted(sorted(picks, key=lambda j: (-row[j], j))[:k])
    return picks + [-1] * (k - len(picks))


TOPK_CASES = [
    pytest.param([0, 0, 0], 4, 10, id="n-zero"),
    pytest.param([3, 1, 2], 4, 10, id="n-lt-k"),
    pytest.param([4, 4, 4], 4, 10, id="n-eq-k"),
    pytest.param([10, 7, 9], 4, 10, id="n-gt-k"),
    pytest.param([0, 4, 10, 5, 2], 4, 10, id="mixed-rows"),
    pytest.param([6, 2, 0], 8, 6, id="width-lt-k"),
]


@pytest.mark.parametrize(("n_visible", "k", "width"), TOPK_CASES)
def test_topk_indices_match_loop(n_visible: list[int], k: int, width: int) -> None:
    gen = torch.Generator().manual_seed(46)
    logits = torch.randn(len(n_visible), width, generator=gen)
    for t, n in enumerate(n_visible):
        logits[t, n:] = 100.0  # beyond n_visible: must never be picked
    got = topk_indices(logits, torch.tensor(n_visible), k)
    assert got.dtype == torch.int32 and got.shape == (len(n_visible), k)
    want = [loop_topk(r, n, k) for r, n in zip(logits.tolist(), n_visible, strict=True)]
    assert got.tolist() == want


def test_topk_indices_ties_at_the_cut() -> None:
    # relu sums are exactly 0 when every head is inactive (errata 2); -0.0 equals 0.0
    logits = torch.tensor(
        [
            [0.0, 3.0, 0.0, -0.0, 2.0, 0.0, -1.0, 0.0],
            [-0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0],
            [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
        ]
    )
    n = torch.tensor([8, 8, 6], dtype=torch.int32)
    got = topk_indices(logits, n, 4)
    want = [loop_topk(r, m, 4) for r, m in zip(logits.tolist(), n.tolist(), strict=True)]
    assert got.tolist() == want == [[0, 1, 2, 4], [0, 1, 2, 7], [0, 1, 2, 3]]
    for t in range(3):  # tie-aware: every pick ≥ every visible non-pick
        picked = set(got[t].tolist()) - {-1}
        rest = [logits[t, j] for j in range(int(n[t])) if j not in picked]
        assert min(logits[t, j] for j in picked) >= max(rest)


def test_topk_indices_exact_n_le_k_even_with_minus_inf_logits() -> None:
    logits = torch.tensor([[NEG_INF, 1.0, NEG_INF, 9.0, 9.0]])
    assert topk_indices(logits, torch.tensor([3]), 4).tolist() == [[0, 1, 2, -1]]
    assert topk_indices(logits, torch.tensor([5]), 4).tolist() == [[0, 1, 3, 4]]


# ---------------------------------------------------------------- candidate blocks


def loop_candidate_blocks(row: list[float], n: int, bs: int, max_blocks: int) -> list[int]:
    n_blocks = -(-len(row) // bs)
    scores = []
    for b in range(n_blocks):
        vis = [row[j] for j in range(b * bs, min((b + 1) * bs, len(row))) if j < n]
        scores.append(max(vis) if vis else NEG_INF)
    if n >= 1 and (n - 1) // bs < n_blocks:
        scores[(n - 1) // bs] = float("inf")
    ranked = sorted(range(n_blocks), key=lambda b: (-scores[b], b))[: min(max_blocks, n_blocks)]
    kept = sorted(b for b in ranked if scores[b] > NEG_INF)
    return kept + [-1] * (max_blocks - len(kept))


CANDIDATE_CASES = [
    pytest.param([16, 16, 16], 4, 2, 16, id="max-blocks-lt-blocks"),
    pytest.param([6, 5, 9], 4, 3, 16, id="partial-newest-block"),
    pytest.param([0, 1, 4], 4, 3, 16, id="n-zero-and-one"),
    pytest.param([13, 16, 3], 4, 8, 16, id="max-blocks-gt-blocks-pads"),
    pytest.param([14, 11, 7], 4, 3, 14, id="width-not-a-multiple"),
    pytest.param([9, 2, 16], 1, 5, 16, id="block-size-1"),
]


@pytest.mark.parametrize(("n_visible", "bs", "max_blocks", "width"), CANDIDATE_CASES)
def test_candidate_blocks_match_loop(
    n_visible: list[int], bs: int, max_blocks: int, width: int
) -> None:
    gen = torch.Generator().manual_seed(47)
    logits = torch.randn(len(n_visible), width, generator=gen)
    for t, n in enumerate(n_visible):
        logits[t, n:] = 50.0  # invisible positions must not score
        if n:
            logits[t, n - 1] = -20.0  # the newest block is forced in even when it scores worst
    got = candidate_blocks(logits, torch.tensor(n_visible), bs, max_blocks)
    assert got.dtype == torch.int32 and got.shape == (len(n_visible), max_blocks)
    want = [
        loop_candidate_blocks(r, n, bs, max_blocks)
        for r, n in zip(logits.tolist(), n_visible, strict=True)
    ]
    assert got.tolist() == want


def test_candidate_blocks_newest_forced_and_empty_dropped() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -9.0, 7.0, 7.0]])
    # n = 8, bs = 3: blocks {0,1,2} {3,4,5} {6,7}; block 2 holds n-1 = 7; block 3 is invisible
    got = candidate_blocks(logits, torch.tensor([8]), 3, 2)
    assert got.tolist() == [[0, 2]]
    assert candidate_blocks(logits, torch.tensor([8]), 3, 6).tolist() == [[0, 1, 2, -1, -1, -1]]


# ---------------------------------------------------------------- top-k among blocks


def loop_topk_among_blocks(row: list[float], n: int, blocks: list[int], bs: int, k: int) -> list:
    cand = [j for j in range(min(n, len(row))) if j // bs in set(blocks) and row[j] > NEG_INF]
    picks = sorted(sorted(cand, key=lambda j: (-row[j], j))[:k])
    return picks + [-1] * (k - len(picks))


AMONG_CASES = [
    pytest.param([16, 16], [[0, 3], [1, 2]], 4, 5, id="fewer-candidates-than-k"),
    pytest.param([16, 16], [[0, 1, 3], [3, 2, 0]], 4, 5, id="pruning"),
    pytest.param([10, 6], [[2, -1, 0], [1, 1, -1]], 4, 5, id="dup-and-pad-ids-partial-block"),
    pytest.param([0, 3], [[0, 1], [0, -1]], 4, 5, id="n-zero"),
    pytest.param([16, 16], [[-1, -1], [7, 0]], 4, 3, id="no-blocks-and-id-beyond-width"),
]


@pytest.mark.parametrize(("n_visible", "block_ids", "bs", "k"), AMONG_CASES)
def test_topk_among_blocks_match_loop(
    n_visible: list[int], block_ids: list[list[int]], bs: int, k: int
) -> None:
    gen = torch.Generator().manual_seed(48)
    logits = torch.randn(len(n_visible), 16, generator=gen)
    logits[:, 1] = NEG_INF  # a -inf candidate is never returned
    for t, n in enumerate(n_visible):
        logits[t, n:] = 80.0
    got = topk_among_blocks(
        logits, torch.tensor(n_visible), torch.tensor(block_ids, dtype=torch.int32), bs, k
    )
    assert got.dtype == torch.int32 and got.shape == (len(n_visible), k)
    want = [
        loop_topk_among_blocks(r, n, b, bs, k)
        for r, n, b in zip(logits.tolist(), n_visible, block_ids, strict=True)
    ]
    assert got.tolist() == want


@pytest.mark.parametrize("n_visible", [[20, 3, 0, 9], [7, 7, 20, 1]], ids=["set-a", "set-b"])
def test_all_blocks_kept_equals_full_topk(n_visible: list[int]) -> None:
    gen = torch.Generator().manual_seed(49)
    logits = torch.randn(4, 20, generator=gen)
    n = torch.tensor(n_visible)
    blocks = candidate_blocks(logits, n, 4, 5)  # 5 blocks of 4: every visible block kept
    got = topk_among_blocks(logits, n, blocks, 4, 6)
    assert torch.equal(got, topk_indices(logits, n, 6))
