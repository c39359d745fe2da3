"""Hyper-connection ops against fp64 per-token loops, Sinkhorn properties, the V4.1 wiring."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from dsv4cp.layers.hyper_connections import HyperConnection, hc_sublayer
from dsv4cp.ops.hyper_connections import (
    hc_collapse,
    hc_expand,
    hc_expand_embedding,
    hc_mixes,
    identity_pre,
    sinkhorn_split,
)

H, D = 4, 64
MIX = (2 + H) * H


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def loop_split(m: list[float], scale: list[float], base: list[float], iters: int, eps: float):
    """One token, plain Python floats (fp64), written from the formulas in the module doc."""
    pre = [_sigmoid(m[i] * scale[0] + base[i]) + eps for i in range(H)]
    post = [2 * _sigmoid(m[H + i] * scale[1] + base[H + i]) for i in range(H)]
    c = [
        [m[2 * H + H * i + j] * scale[2] + base[2 * H + H * i + j] for j in range(H)]
        for i in range(H)
    ]
    for i in range(H):
        top = max(c[i])
        e = [math.exp(v - top) for v in c[i]]
        c[i] = [v / sum(e) + eps for v in e]

    def cols() -> None:
        sums = [sum(c[i][j] for i in range(H)) + eps for j in range(H)]
        for i in range(H):
            c[i] = [c[i][j] / sums[j] for j in range(H)]

    cols()
    for _ in range(iters - 1):
        for i in range(H):
            s = sum(c[i]) + eps
            c[i] = [v / s for v in c[i]]
        cols()
    return pre, post, c


def _params(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    fn = torch.randn(MIX, H * D, generator=g) * 0.05
    base = torch.randn(MIX, generator=g)
    scale = torch.rand(3, generator=g) + 0.5
    return fn, base, scale


@pytest.mark.parametrize("iters", [1, 2, 20])
def test_sinkhorn_split_matches_fp64_loop(iters: int) -> None:
    g = torch.Generator().manual_seed(iters)
    logits = torch.randn(5, MIX, generator=g) * 3
    _, base, scale = _params(1)
    got = sinkhorn_split(logits, scale, base, hc_mult=H, iters=iters, eps=1e-6)
    for t in range(5):
        want = loop_split(logits[t].tolist(), scale.tolist(), base.tolist(), iters, 1e-6)
        for ours, theirs, rtol in zip(got, want, (1e-6, 1e-6, 1e-5)):
            theirs = torch.tensor(theirs, dtype=torch.float64)
            torch.testing.assert_close(ours[t].double(), theirs, rtol=rtol, atol=1e-7)


def test_sinkhorn_converges_to_doubly_stochastic() -> None:
    logits = torch.randn(64, MIX, generator=torch.Generator().manual_seed(3)) * 4
    _, base, scale = _params(2)
    row_err = []
    for iters in (1, 5, 20, 100, 1000):  # peaked rows (logits x4) converge slowly
        comb = sinkhorn_split(logits, scale, base, hc_mult=H, iters=iters, eps=1e-6).comb
        assert (comb > 0).all()
        # every round ends on the columns: sums S / (S + eps), 1 once S is near 1
        cols = comb.sum(-2)
        assert (cols <= 1 + 1e-6).all()
        assert iters == 1 or (cols >= 1 - 1e-5).all()
        row_err.append((comb.sum(-1) - 1).abs().max().item())
    assert row_err[-1] < 1e-5 < row_err[0]
    assert row_err == sorted(row_err, reverse=True)


def test_pre_and_post_ranges() -> None:
    logits = torch.randn(32, MIX, generator=torch.Generator().manual_seed(4)) * 50
    _, base, scale = _params(3)
    mixes = sinkhorn_split(logits, scale, base, hc_mult=H, iters=20, eps=1e-6)
    assert ((mixes.pre >= 1e-6) & (mixes.pre <= 1 + 1e-6)).all()
    assert ((mixes.post >= 0) & (mixes.post <= 2)).all()


def test_mixes_depend_on_the_token_rms_not_its_scale() -> None:
    fn, base, scale = _params(5)
    x = torch.randn(6, H, D, generator=torch.Generator().manual_seed(6))
    kw = {"norm_eps": 1e-20, "sinkhorn_iters": 20, "hc_eps": 1e-6}
    a, b = hc_mixes(x, fn, base, scale, **kw), hc_mixes(x * 37.0, fn, base, scale, **kw)
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)


def test_mix_logits_use_one_rms_over_all_streams() -> None:
    fn, base, scale = _params(7)
    x = torch.randn(3, H, D, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    flat = x.flatten(1)
    logits = (flat @ fn.double().t()) / flat.square().mean(-1, keepdim=True).sqrt()
    want = sinkhorn_split(logits, scale, base, hc_mult=H, iters=20, eps=1e-6)
    got = hc_mixes(x.float(), fn, base, scale, norm_eps=1e-20, sinkhorn_iters=20, hc_eps=1e-6)
    for u, v in zip(got, want):
        torch.testing.assert_close(u, v.float(), rtol=1e-5, atol=1e-6)


def test_collapse_and_expand_match_fp64() -> None:
    g = torch.Generator().manual_seed(9)
    x = torch.randn(5, H, D, generator=g)
    y = torch.randn(5, D, generator=g)
    pre, post, comb = (
        torch.rand(5, H, generator=g),
        torch.rand(5, H, generator=g),
        torch.rand(5, H, H, generator=g),
    )
    want_c = torch.einsum("th,thd->td", pre.double(), x.double())
    want_e = post.double()[..., None] * y.double()[:, None] + torch.einsum(
        "tij,tid->tjd", comb.double(), x.double()
    )
    torch.testing.assert_close(hc_collapse(x, pre).double(), want_c, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hc_expand(y, x, post, comb).double(), want_e, rtol=1e-6, atol=1e-6)
    # bf16 streams: fp32 math, one rounding at the end
    xb, yb = x.bfloat16(), y.bfloat16()
    assert torch.equal(hc_collapse(xb, pre), hc_collapse(xb.float(), pre).bfloat16())
    assert torch.equal(
        hc_expand(yb, xb, post, comb), hc_expand(yb.float(), xb.float(), post, comb).bfloat16()
    )


def test_identity_pre_recovers_the_embedding() -> None:
    emb = torch.randn(7, D, generator=torch.Generator().manual_seed(10)).bfloat16()
    streams = hc_expand_embedding(emb, H)
    assert streams.shape == (7, H, D)
    assert torch.equal(hc_collapse(streams, identity_pre(emb[:, 0], H)), emb)


def test_mixes_are_row_local() -> None:
    """CP shards rows: any split of the tokens gives the same per-token coefficients (up to the
    fp32 rounding of a GEMM whose blocking depends on the row count)."""
    fn, base, scale = _params(11)
    x = torch.randn(13, H, D, generator=torch.Generator().manual_seed(12)).bfloat16()
    kw = {"norm_eps": 1e-20, "sinkhorn_iters": 20, "hc_eps": 1e-6}
    whole = hc_mixes(x, fn, base, scale, **kw)
    parts = [hc_mixes(x[a:b], fn, base, scale, **kw) for a, b in ((0, 5), (5, 6), (6, 13))]
    for k in range(3):
        torch.testing.assert_close(whole[k], torch.cat([p[k] for p in parts]), rtol=1e-6, atol=1e-6)


def test_bad_shapes_are_value_errors() -> None:
    fn, base, scale = _params(13)
    x = torch.randn(2, H, D)
    kw = {"norm_eps": 1e-20, "sinkhorn_iters": 20, "hc_eps": 1e-6}
    with pytest.raises(ValueError, match="fn must be"):
        hc_mixes(x[:, :3], fn, base, scale, **kw)
    with pytest.raises(ValueError, match="base must be"):
        hc_mixes(x, fn, base[:-1], scale, **kw)
    with pytest.raises(ValueError, match="hc_sinkhorn_iters"):
        sinkhorn_split(torch.zeros(1, MIX), scale, base, hc_mult=H, iters=0, eps=1e-6)
    with pytest.raises(ValueError, match="pre must be"):
        hc_collapse(x, torch.ones(2, H + 1))
    with pytest.raises(ValueError, match="comb"):
        hc_expand(x[:, 0], x, torch.ones(2, H), torch.ones(2, H))


def _connection(sublayer: str, seed: int) -> HyperConnection:
    cfg = SimpleNamespace(
        hc_mult=H, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-20, hidden_size=D
    )
    conn = HyperConnection(cfg, sublayer, device="cpu")  # type: ignore[arg-type]
    fn, base, scale = _params(seed)
    with torch.no_grad():
        conn.fn.copy_(fn)
        conn.base.copy_(base)
        conn.scale.copy_(scale)
    return conn


def test_sublayer_collapses_with_the_previous_pre_and_hands_on_its_own() -> None:
    conn = _connection("ffn", 14)
    x = torch.randn(5, H, D, generator=torch.Generator().manual_seed(15))
    handed = torch.rand(5, H, generator=torch.Generator().manual_seed(16))
    seen = {}

    def sublayer(y: torch.Tensor) -> torch.Tensor:
        seen["in"] = y
        return 2 * y

    out, next_pre = hc_sublayer(x, handed, conn, sublayer)
    mixes = conn(x)
    assert torch.equal(seen["in"], hc_collapse(x, handed))
    assert torch.equal(next_pre, mixes.pre)
    assert torch.equal(out, hc_expand(2 * hc_collapse(x, handed), x, mixes.post, mixes.comb))
    assert list(conn.checkpoint_slots("layers.2.")) == [
        "layers.2.hc_ffn_fn",
        "layers.2.hc_ffn_base",
        "layers.2.hc_ffn_scale",
    ]
    with pytest.raises(ValueError, match="sublayer"):
        _connection("mlp", 0)
