"""GPU: the fused indexer logits + selection kernels against the ops twins at V4.1-Flash dims.

Integer-valued inputs (bf16 small integers, power-of-two head weights) make every logit exact in
fp32, so the selections must be identical to the twins', exact ties included; random bf16
inputs are checked tie-aware against the logits kernel's own logits. CPU: interpreter cases in
test_indexer_topk_interpreter.py, the sm90 compile in test_indexer_topk_compile.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dsv4cp import ops, routing
from dsv4cp.kernels.indexer_logits import mqa_logits as kernel_logits
from dsv4cp.kernels.indexer_topk import launch_mqa_topk

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
H, D = 32, 128


def _ints(t: int, n: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randint(-3, 4, (t, H, D), device="cuda", generator=g).bfloat16()
    k = torch.randint(-3, 4, (n, D), device="cuda", generator=g).bfloat16()
    scales = torch.tensor([0.5, -0.25, 1.0, 2.0, -1.0], device="cuda")
    w = scales[torch.randint(0, 5, (t, H), device="cuda", generator=g)]
    return q, w, k, g


def _equal(got: torch.Tensor, want: torch.Tensor) -> None:
    bad = (got != want).any(1).nonzero().flatten()[:4].tolist()
    assert not bad, f"rows {bad} differ:\n{got[bad]}\n{want[bad]}"


@pytest.mark.parametrize(
    ("t", "n", "k_top", "width"),
    [
        (2048, 16384, 512, None),  # one piece per row block
        (64, 100000, 512, None),  # one row block: the width split into pieces, merged
        (300, 5000, 1024, 4000),
        (1, 700, 8, None),
    ],
)
@pytest.mark.parametrize("route", ["scan", "logits"])
def test_full_topk_matches_ops(t: int, n: int, k_top: int, width: int | None, route: str) -> None:
    q, w, k, g = _ints(t, n, seed=t + n)
    nv = torch.randint(0, n + 1, (t,), device="cuda", generator=g)
    if t >= 4:
        nv[:4] = torch.tensor([n, 0, k_top, k_top + 1], device="cuda")
    want = ops.mqa_topk(q, w, k, nv, k_top, width=width)
    _equal(launch_mqa_topk(q, w, k, nv, k_top, width=width, route=route)[0], want)
    _equal(routing.mqa_topk(q, w, k, nv, k_top, width=width), want)  # the width's pick


def test_two_requests_causal() -> None:
    t, n = 1536, 9000  # request 1: 700 rows after a 4000-entry prefix; request 2: 836 rows
    q, w, k, _ = _ints(t, n, seed=1)
    ks = torch.cat([torch.zeros(700), torch.full((836,), 4700.0)]).long().cuda()
    nv = torch.cat([4000 + torch.arange(1, 701), torch.arange(1, 837) * 5]).cuda()
    want = ops.mqa_topk(q, w, k, nv, 512, k_start=ks, width=4700)
    _equal(routing.mqa_topk(q, w, k, nv, 512, k_start=ks, width=4700), want)
    for route in ("scan", "logits"):
        got = launch_mqa_topk(q, w, k, nv, 512, k_start=ks, width=4700, route=route)[0]
        _equal(got, want)


def test_candidate_source_and_consumer() -> None:
    t, n = 256, 40000  # 5000 blocks of 8: more than the 2048 published
    q, w, k, g = _ints(t, n, seed=2)
    nv = n - 255 + torch.arange(t, device="cuda")
    top, blocks = routing.mqa_topk_candidates(q, w, k, nv, 512, 8, 2048)
    want_top, want_blocks = ops.mqa_topk_candidates(q, w, k, nv, 512, 8, 2048)
    _equal(top, want_top)
    _equal(blocks, want_blocks)
    q2, w2, _, _ = _ints(t, n, seed=3)  # the consumer's own queries over the same keys
    got = routing.mqa_topk_among_blocks(q2, w2, k, nv, blocks, 8, 512)
    _equal(got, ops.mqa_topk_among_blocks(q2, w2, k, nv, blocks, 8, 512))


def test_consumer_gather_at_long_context() -> None:
    t, n = 128, 200000  # 25000 blocks, 2048 published: "auto" gathers them
    q, w, k, g = _ints(t, n, seed=6)
    nv = n - 127 + torch.arange(t, device="cuda")
    _, blocks = routing.mqa_topk_candidates(q, w, k, nv, 512, 8, 2048)
    q2, w2, _, _ = _ints(t, n, seed=7)
    want = ops.mqa_topk_among_blocks(q2, w2, k, nv, blocks, 8, 512)
    _equal(routing.mqa_topk_among_blocks(q2, w2, k, nv, blocks, 8, 512), want)
    for mode in ("map", "gather"):
        got, _ = launch_mqa_topk(q2, w2, k, nv, 512, block_ids=blocks, block_size=8, consumer=mode)
        _equal(got, want)


def test_random_bf16_tie_aware() -> None:
    g = torch.Generator(device="cuda").manual_seed(4)
    t, n, k_top = 512, 30000, 512
    q = torch.randn(t, H, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(n, D, device="cuda", generator=g).bfloat16()
    w = torch.randn(t, H, device="cuda", generator=g) / 64
    nv = torch.randint(0, n + 1, (t,), device="cuda", generator=g)
    sel = routing.mqa_topk(q, w, k, nv, k_top)
    logits = kernel_logits(q, w, k, nv)
    picked = sel >= 0
    assert torch.equal(picked.sum(1), nv.clamp(max=k_top).to(picked.sum(1).dtype))
    chosen = torch.zeros(t, n + 1, dtype=torch.bool, device="cuda")
    chosen.scatter_(1, torch.where(picked, sel, n).long(), True)
    chosen = chosen[:, :n]
    visible = torch.arange(n, device="cuda")[None, :] < nv[:, None]
    low = torch.where(chosen, logits, float("inf")).amin(1)
    high = torch.where(visible & ~chosen, logits, float("-inf")).amax(1)
    assert torch.all(low >= high - 1e-4 * logits.abs().amax()), "a larger logit was left out"


@pytest.mark.parametrize("config", [(64, 128, 4, 2), (64, 128, 8, 2), (64, 64, 4, 2)])
def test_configs_and_graph_capture(config: tuple[int, int, int, int]) -> None:
    t, n = 700, 20000
    q, w, k, g = _ints(t, n, seed=5)
    nv = torch.randint(0, n + 1, (t,), device="cuda", generator=g)
    want = ops.mqa_topk(q, w, k, nv, 512)
    _equal(launch_mqa_topk(q, w, k, nv, 512, config=config)[0], want)
    out = torch.empty_like(want)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out.copy_(launch_mqa_topk(q, w, k, nv, 512, config=config)[0])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(launch_mqa_topk(q, w, k, nv, 512, config=config)[0])
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    _equal(out, want)


@pytest.mark.parametrize("packed", [True, False])
def test_qat_matches_ops_packed_or_not(packed: bool) -> None:
    """qat at Flash dims, integer inputs: each head's term and the head sum are rounded to bf16
    as the twin rounds them (many exact ties), so the selections equal the twin's, with the
    packed two-value roundings (default) and with one value per instruction (packed=False):
    full top-k, the candidate source's blocks, the consumer's map and gather modes."""
    t, n = 1024, 12000
    q, w, k, g = _ints(t, n, seed=11)
    nv = torch.randint(0, n + 1, (t,), device="cuda", generator=g)
    nv[:3] = torch.tensor([n, 0, 513], device="cuda")
    want = ops.mqa_topk(q, w, k, nv, 512, quant="qat")
    want_top, want_blocks = ops.mqa_topk_candidates(q, w, k, nv, 512, 8, 256, quant="qat")
    want_among = ops.mqa_topk_among_blocks(q, w, k, nv, want_blocks, 8, 512, quant="qat")
    kw = dict(quant="qat", packed=packed)
    _equal(launch_mqa_topk(q, w, k, nv, 512, **kw)[0], want)
    top, blocks = launch_mqa_topk(q, w, k, nv, 512, block_size=8, max_blocks=256, **kw)
    assert blocks is not None
    _equal(top, want_top)
    _equal(blocks, want_blocks)
    for mode in ("map", "gather"):
        got, _ = launch_mqa_topk(
            q, w, k, nv, 512, block_ids=want_blocks, block_size=8, consumer=mode, **kw
        )
        _equal(got, want_among)


def test_qat_packed_equals_unpacked_on_random_inputs() -> None:
    """Random bf16 queries and keys, fp32 weights: the packed roundings are the same bits as the
    single ones (bf16 · bf16 is exact in fp32, rounded once either way), so the selections are
    identical, ties and all."""
    g = torch.Generator(device="cuda").manual_seed(12)
    t, n = 768, 20000
    q = torch.randn(t, H, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(n, D, device="cuda", generator=g).bfloat16()
    w = torch.randn(t, H, device="cuda", generator=g) / 8
    nv = torch.randint(0, n + 1, (t,), device="cuda", generator=g)
    a = launch_mqa_topk(q, w, k, nv, 512, quant="qat", block_size=8, max_blocks=512)
    b = launch_mqa_topk(q, w, k, nv, 512, quant="qat", block_size=8, max_blocks=512, packed=False)
    _equal(a[0], b[0])
    assert a[1] is not None and b[1] is not None
    _equal(a[1], b[1])


@pytest.mark.parametrize(("t", "pieces"), [(2048, None), (64, 1)])
def test_seeded_scan_and_its_redo_match_ops(t: int, pieces: int | None) -> None:
    """A CP 8 rank's rows of an r2 source (2048 rows at 64K entries: 8 pieces, merged) and one
    row block in one piece (the direct write), qat, integer inputs: the planned seed (every
    128th column's 20th largest), no seed, and rank 1 (the sample's largest: most rows short,
    redone without a seed) all select what the twin selects, top-k and candidate blocks."""
    n = 65536
    q, w, k, g = _ints(t, n, seed=21 + t)
    nv = torch.arange(n - t + 1, n + 1, device="cuda")
    nv[:3] = torch.tensor([n, 0, 513], device="cuda")
    want = ops.mqa_topk(q, w, k, nv, 512, quant="qat")
    want_top, want_blocks = ops.mqa_topk_candidates(q, w, k, nv, 512, 8, 256, quant="qat")
    for knobs in ({}, {"seed_stride": 0}, {"seed_rank": 1}):
        kw = dict(quant="qat", route="scan", pieces=pieces, **knobs)
        _equal(launch_mqa_topk(q, w, k, nv, 512, **kw)[0], want)
        top, blocks = launch_mqa_topk(q, w, k, nv, 512, block_size=8, max_blocks=256, **kw)
        assert blocks is not None
        _equal(top, want_top)
        _equal(blocks, want_blocks)


@pytest.mark.parametrize(("pieces", "form"), [(None, ("magic", False)), (3, ("magic", False)),
                                              (None, ("cvt", True))])  # fmt: skip
def test_int8_scan_selects_as_the_bf16_scan(pieces: int | None, form: tuple[str, bool]) -> None:
    """`int8_scan=True` (the scan's qat logits on int8 MMAs where a tile's rows and keys are
    encoded exactly, bf16 MMAs elsewhere) at Flash dims on fake-fp4 inputs: the bf16 scan's
    selections bit for bit — plain top-k with the seed and its redo, two requests (k_start),
    the candidate source's blocks and the consumer's map mode, with a key and a query row the
    encoding cannot hold (their tiles on the bf16 steps); the head loop's two forms, the
    magic-number add with max and mul, and cvt with relu_fma (the default;
    `indexer_logits_int8.SCAN_CONVERT`, `SCAN_RELU_FMA`)."""
    from dsv4cp.kernels import indexer_logits_int8 as int8
    from dsv4cp.kernels import indexer_topk as kern

    shipped = int8.SCAN_CONVERT, int8.SCAN_RELU_FMA
    int8.SCAN_CONVERT, int8.SCAN_RELU_FMA = form
    try:
        _int8_scan_cases(pieces, kern)
    finally:
        int8.SCAN_CONVERT, int8.SCAN_RELU_FMA = shipped


def _int8_scan_cases(pieces: int | None, kern: Any) -> None:
    from dsv4cp.ops.attention_quant import fake_quant_index_fp4

    g = torch.Generator(device="cuda").manual_seed(31)
    t, n = 600, 9000
    q = fake_quant_index_fp4(torch.randn(t, H, D, device="cuda", generator=g)).bfloat16()
    k = fake_quant_index_fp4(torch.randn(n, D, device="cuda", generator=g)).bfloat16()
    w = torch.randn(t, H, device="cuda", generator=g) / H
    k[9] *= 4.0
    k[9, 32:64] *= 2.0**-9  # not n · 2^E: the tiles holding key 9 take the bf16 steps
    q[70, 4, 32:64] *= 2.0**-9
    ks = torch.cat([torch.zeros(300), torch.full((300,), 3000.0)]).long().cuda()
    nv = torch.cat([2700 + torch.arange(1, 301), 5700 + torch.arange(1, 301)]).cuda()
    nv[:2] = torch.tensor([0, 513], device="cuda")

    def both(**kw: object) -> None:
        a = launch_mqa_topk(q, w, k, nv, 512, quant="qat", pieces=pieces, int8_scan=True, **kw)
        b = launch_mqa_topk(q, w, k, nv, 512, quant="qat", pieces=pieces, int8_scan=False, **kw)
        _equal(a[0], b[0])
        if b[1] is not None:
            assert a[1] is not None
            _equal(a[1], b[1])

    both(route="scan")  # the width 6000 ≥ 4K: the seed's three passes
    both(route="scan", seed_rank=1)  # most rows short: redone
    both(k_start=ks, width=6000, route="scan")
    both(k_start=ks, width=6000, block_size=8, max_blocks=256)
    _, blocks = launch_mqa_topk(q, w, k, nv, 512, quant="qat", block_size=8, max_blocks=256)
    assert blocks is not None
    both(k_start=ks, width=6000, block_ids=blocks, block_size=8, consumer="map")
    # the control: the int8 path is taken (a wrong key scale changes the selection)
    encode = kern.encode_int8

    def wrong_scale(x: torch.Tensor, *a: object) -> tuple[torch.Tensor, ...]:
        codes, scale, ok = encode(x, *a)  # type: ignore[arg-type]
        return codes, scale * (1 + (torch.arange(len(scale), device="cuda") % 2)), ok

    try:
        kern.encode_int8 = wrong_scale  # type: ignore[assignment]
        got = launch_mqa_topk(q, w, k, nv, 512, quant="qat", route="scan", int8_scan=True)[0]
    finally:
        kern.encode_int8 = encode
    assert not torch.equal(got, launch_mqa_topk(q, w, k, nv, 512, quant="qat", route="scan")[0])
