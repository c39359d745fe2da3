"""The expert-parallel MoE twins without a group: N ranks simulated by hand (dispatch, the
exchange as slicing, each rank's experts, the exchange back, combine) equal `moe`, bit for bit."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.ops.moe import combine, moe
from dsv4cp.ops.moe_ep import (
    ep_dispatch,
    ep_local_experts,
    ep_pack,
    ep_per_token,
    pack_pairs,
    unpack_pairs,
)
from dsv4cp.ops.moe_experts import expert_mlp
from dsv4cp.ops.moe_routing import route
from dsv4cp.ops.moe_weights import ExpertStack
from tests.ops.test_moe import SPEC, E, _weights


def test_pack_round_trip() -> None:
    x = torch.randn(5, 64).bfloat16()
    w = torch.rand(5)
    rows = pack_pairs(x, torch.arange(5), w, torch.tensor([9, 0, 3, 2**31 - 1, 7]))
    assert rows.dtype == torch.uint8 and rows.shape == (5, 128 + 12)
    x2, e, w2, t = unpack_pairs(rows, torch.bfloat16, 64)
    assert torch.equal(x2, x) and torch.equal(w2, w) and e.tolist() == list(range(5))
    assert t.tolist() == [9, 0, 3, 2**31 - 1, 7]


@pytest.mark.parametrize("quant,dtype", [("none", torch.float32), ("qat", torch.bfloat16)])
@pytest.mark.parametrize("n", [2, 4])
def test_simulated_ranks_equal_moe(n: int, quant: str, dtype: torch.dtype) -> None:
    gate_w, gate_b, experts, shared = _weights(3)
    x = torch.randn(19, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    want = moe(
        x,
        gate_weight=gate_w,
        gate_bias=gate_b,
        experts=experts,
        shared=shared,
        spec=SPEC,
        quant=quant,  # type: ignore[arg-type]
        backend="loop",
    )
    per = E // n
    ids = [torch.arange(r, x.shape[0], n) for r in range(n)]
    ids = [torch.cat([i, torch.tensor([-1])]) for i in ids]  # one CP padding row each
    xs = [torch.where((i >= 0)[:, None], x[i.clamp(min=0)], 0) for i in ids]
    routings = [route(xr, gate_w, gate_b, SPEC) for xr in xs]
    plans = [ep_dispatch(rt, i, n, per) for rt, i in zip(routings, ids)]
    splits = [p.counts.tolist() for p in plans]
    pairs = [p.order[: sum(s)] for p, s in zip(plans, splits)]
    sent = [ep_pack(xr, rt, i, pr, per) for xr, rt, i, pr in zip(xs, routings, ids, pairs)]
    outs = []
    for dst in range(n):  # the dispatch all_to_all, by slicing
        parts = [sent[src][sum(splits[src][:dst]) :][: splits[src][dst]] for src in range(n)]
        local = tuple(
            ExpertStack(s.weight[dst * per : (dst + 1) * per], s.scale[dst * per : (dst + 1) * per])
            for s in experts
        )
        outs.append(ep_local_experts(torch.cat(parts), dtype, local, SPEC, quant, "loop"))  # type: ignore[arg-type]
    got = torch.empty_like(want)
    for src in range(n):  # the combine all_to_all: each owner's block of src's rows, in order
        offs = [sum(splits[s][d] for s in range(src)) for d in range(n)]
        back = torch.cat([outs[d][offs[d] : offs[d] + splits[src][d]] for d in range(n)])
        per_token = ep_per_token(back, pairs[src], xs[src].shape[0], SPEC.num_experts_per_tok)
        sh = expert_mlp(xs[src], *shared, swiglu_limit=SPEC.swiglu_limit, quant=quant)  # type: ignore[arg-type]
        y = combine(per_token, sh, dtype)
        got[src::n] = y[ids[src] >= 0]
    assert torch.equal(got, want)
