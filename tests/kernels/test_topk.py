"""GPU: the top-k kernel against ops.indexer.topk_indices.

Both break exact ties toward the smaller index, so the outputs must be identical; each output is
also checked on its own terms (count min(n, k), ascending, -1 pads last, and every selected logit
≥ every visible unselected one: a tie-aware set check).
"""

from __future__ import annotations

import pytest
import torch

from dsv4cp import ops, routing
from dsv4cp.kernels.topk import launch_topk, topk_indices

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _check_valid(sel: torch.Tensor, logits: torch.Tensor, nv: torch.Tensor, k: int) -> None:
    t, w = logits.shape
    picked = sel >= 0
    count = picked.sum(1)
    assert torch.equal(count, torch.minimum(nv.clamp(0, w), torch.tensor(k, device=nv.device)))
    pos = torch.arange(k, device=sel.device)
    assert torch.all(picked == (pos[None, :] < count[:, None])), "-1 pads are not last"
    big = torch.where(picked, sel, torch.iinfo(torch.int32).max)
    assert torch.all((big[:, 1:] > big[:, :-1]) | ~picked[:, 1:]), "not strictly ascending"
    chosen = torch.zeros(t, w + 1, dtype=torch.bool, device=sel.device)  # column w: the pads
    chosen.scatter_(1, torch.where(picked, sel, w).long(), True)
    chosen = chosen[:, :w]
    visible = torch.arange(w, device=sel.device)[None, :] < nv[:, None]
    low = torch.where(chosen, logits, float("inf")).amin(1)
    high = torch.where(visible & ~chosen, logits, float("-inf")).amax(1)
    assert torch.all(low >= high), "a larger visible logit was left out"


@pytest.mark.parametrize(
    ("t", "w", "k"),
    [
        (64, 16384, 512),
        (64, 16384, 1024),
        (17, 40000, 512),
        (9, 140000, 1024),
        (33, 5000, 1024),
        (1, 700, 8),
    ],
)
def test_matches_ops(t: int, w: int, k: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(t + w + k)
    logits = torch.randn(t, w, device="cuda", generator=g)
    logits = logits.bfloat16().float()  # bf16 scores: many exact ties, as in V4.1 on Hopper
    nv = torch.randint(0, w + 1, (t,), device="cuda", generator=g)
    nv[0] = w
    if t > 3:
        nv[1:4] = torch.tensor([0, k, k + 1], device="cuda")
    sel = topk_indices(logits, nv, k)
    _check_valid(sel, logits, nv, k)
    assert torch.equal(sel, ops.topk_indices(logits, nv, k))


def test_streaming_path_and_heavy_ties() -> None:
    t, w, k = 9, 3000, 512
    logits = torch.randint(0, 3, (t, w), device="cuda").float()
    logits[0, ::2] = -0.0
    logits[1] = float("-inf")
    nv = torch.tensor([3000, 3000, 600, 513, 512, 2999, 100, 0, 2048], device="cuda")
    for kwargs in (
        {},
        {"piece": 1024},  # the slots merge
        {"piece": 1024, "merge": "stream"},
        {"piece": 1024, "merge": "stream", "cap": 1024},  # cap: the stream merge's overflow
    ):
        sel = launch_topk(logits, nv, k, **kwargs)
        _check_valid(sel, logits, nv, k)
        assert torch.equal(sel, ops.topk_indices(logits, nv, k))


def test_unsupported_k_raises() -> None:
    logits = torch.randn(2, 10, device="cuda")
    with pytest.raises(ValueError, match="k must be in"):
        routing.topk_indices(logits, torch.full((2,), 10, device="cuda"), 5000)


@pytest.mark.parametrize("w", [8192, 40000])
def test_bf16_scores_16_bit_search_matches_twin(w: int) -> None:
    """qat's index scores are bf16 values: the 16-bit searches (over bf16 pairs, the logits
    route's, and over int32 keys) pick what the twin picks — heavy ties, both signs, the cut
    among ±0 (they tie), ±inf, NaNs (a piece holding one falls back to the int32 keys), rows with
    ≤ k visible, by the slots merge at its own and other piece widths and by the stream merge."""
    g = torch.Generator(device="cuda").manual_seed(w)
    t, k = 24, 512
    logits = (torch.randn(t, w, device="cuda", generator=g) * 4).bfloat16().float()
    logits[0] = torch.randint(-2, 3, (w,), device="cuda", generator=g).float()  # ties
    logits[1, ::3] = -0.0
    logits[2, ::5] = float("inf")
    logits[3] = float("-inf")
    logits[3, ::9] = 1.0
    logits[4] = -logits[4].abs()  # all negative
    logits[8, ::2], logits[8, 1::2] = 0.0, -0.0
    logits[8, 3000:3100] = 1.0
    logits[9, 5000] = logits[9, 7001] = float("nan")  # above +inf in the twin's order
    nv = torch.randint(k + 1, w + 1, (t,), device="cuda", generator=g)
    nv[5:8] = torch.tensor([0, k, k + 1], device="cuda")
    nv[8:10] = w
    want = ops.topk_indices(logits, nv, k)
    assert (want[9] == 5000).any() and (want[9] == 7001).any()  # the NaNs are picked
    wide = ({"piece": 16384},) if w > 16384 else ()
    for kw in ({}, {"packed": False}, {"piece": 4096}, {"merge": "stream"}, *wide):
        got = launch_topk(logits, nv, k, key_bits=16, **kw)
        ok = torch.ones(t, dtype=torch.bool, device="cuda")
        ok[9] = False  # the set check cannot order NaNs
        _check_valid(got[ok], logits[ok], nv[ok], k)
        assert torch.equal(got, want), kw
