"""kernels/indexer_topk on the CPU through Triton's interpreter, against the ops twins.

TRITON_INTERPRET must be set before triton is imported, so the cases run in one child process
(this file as a script) and report back as JSON. Inputs are small integers (weights powers of
two), so every logit is exact in fp32 whatever the summation order and the selections must be
identical to the twins', ties included (integers tie often, and the tie rule — the smaller index —
is what is tested). One case uses random floats and checks the selection on its own terms against
fp64 logits (the interpreter's fp32 dot rounds differently from torch's).

Shapes are tiny (the interpreter steps every program in Python); small `cap` and `pieces` force
the paths that the real shapes take: buffer cuts in the middle of a row, several pieces merged,
row blocks holding two requests (two k_start values).
"""

from __future__ import annotations

import sys

import pytest

from tests.kernels.interpreter_child import report_cases, run_interpreter_cases

CASES = (
    "full_one_piece",
    "full_pieces_and_cuts",
    "full_bf16_two_requests",
    "rising_logits_cut_every_tile",
    "candidates",
    "consumer",
    "consumer_gather",
    "random_floats_tie_aware",
    "qat_key_bits",
    "logits_route",
    "pieces_merged_raw_or_cut",
    "seeded_scan_and_redo",
    "int8_scan_plain",
    "int8_scan_candidates_and_consumer",
    "int8_scan_seeded",
    "int8_scan_fallback_tiles",
)
CFG = (16, 32, 4, 1)  # BLOCK_T, BLOCK_N, warps, stages: several row blocks and tiles


@pytest.fixture(scope="module")
def child_results() -> dict[str, str]:
    return run_interpreter_cases(__file__, CASES)


@pytest.mark.parametrize("case", CASES)
def test_indexer_topk_in_the_interpreter(case: str, child_results: dict[str, str]) -> None:
    assert child_results[case] == "ok", child_results[case]


def test_launcher_limits() -> None:
    import torch

    from dsv4cp.kernels.indexer_topk import check_mqa_topk, launch_mqa_topk

    q, w, k, nv = torch.zeros(2, 4, 16), torch.zeros(2, 4), torch.zeros(9, 16), torch.ones(2)
    with pytest.raises(ValueError, match="k_top must be in"):
        check_mqa_topk(q, w, k, nv, 5000)
    with pytest.raises(ValueError, match="D_I must be a power of two"):
        check_mqa_topk(torch.zeros(2, 4, 24), w, torch.zeros(9, 24), nv, 8)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        launch_mqa_topk(q, w, k, nv, 8, max_blocks=4, block_size=6)
    with pytest.raises(ValueError, match="exclude"):
        launch_mqa_topk(q, w, k, nv, 8, max_blocks=4, block_ids=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="cap 32 must be a power of two"):
        launch_mqa_topk(q, w, k, nv, 8, cap=32, config=(16, 32, 4, 1))
    with pytest.raises(ValueError, match="consumer must be"):
        launch_mqa_topk(q, w, k, nv, 8, block_ids=torch.zeros(2, 3), consumer="dense")
    with pytest.raises(ValueError, match="key_bits 16 must be 32, or 16 in qat"):
        launch_mqa_topk(q, w, k, nv, 8, key_bits=16)  # fp32 scores need all 32 bits
    with pytest.raises(ValueError, match="key_bits 8 must be"):
        launch_mqa_topk(q, w, k, nv, 8, key_bits=8, quant="qat")
    with pytest.raises(ValueError, match="route must be one of"):
        launch_mqa_topk(q, w, k, nv, 8, route="fused")
    with pytest.raises(ValueError, match="plain top-k only"):
        launch_mqa_topk(q, w, k, nv, 8, max_blocks=4, block_size=4, route="logits")
    for knob in ({"config": (16, 32, 4, 1)}, {"pieces": 2}, {"cap": 64}, {"consumer": "map"}):
        with pytest.raises(ValueError, match="knobs were given to the logits route"):
            launch_mqa_topk(q, w, k, nv, 8, route="auto", **knob)  # type: ignore[arg-type]
    # `packed` is not refused there: the logits kernel's qat steps take it too
    from dsv4cp.kernels.indexer_topk import LOGITS_ROUTE_MAX_WIDTH, pick_route

    assert pick_route("auto", LOGITS_ROUTE_MAX_WIDTH, False) == "logits"
    assert pick_route("auto", LOGITS_ROUTE_MAX_WIDTH + 1, False) == "scan"
    # wider: by rows, at least one per LOGITS_ROUTE_KEYS_PER_ROW keys (a cold prefill: 1 per ½)
    from dsv4cp.kernels.indexer_topk import LOGITS_ROUTE_KEYS_PER_ROW as per_row

    assert pick_route("auto", 32768, False, rows=65536) == "logits"
    assert pick_route("auto", 65536, False, rows=65536 // per_row) == "logits"
    assert pick_route("auto", 65536, False, rows=65536 // per_row - 1) == "scan"
    assert pick_route("auto", 65536, True, rows=65536) == "scan"
    assert pick_route("auto", 16, True) == "scan"  # candidates always scan


def test_pieces_fill_whole_waves() -> None:
    from dsv4cp.kernels.indexer_topk import plan_pieces

    # H200: 132 SMs, 2 scan programs each. CP 4 / CP 8 ranks of a 16K chunk at 112K (64 / 32
    # row blocks of 64): one wave of 256 programs, not 320 / 288 (two waves)
    assert plan_pieces(64, 132, 2, 16) == 4
    assert plan_pieces(32, 132, 2, 16) == 8
    # cold 16K (256 row blocks, at most 2 pieces of a 8K width) and 64K (1024): as before
    assert plan_pieces(256, 132, 2, 2) == 2
    assert plan_pieces(1024, 132, 2, 16) == 1
    assert plan_pieces(3, 4, 1, 1) == 1
    with pytest.raises(ValueError, match="must be ≥ 1"):
        plan_pieces(0, 132, 2, 4)


def test_seed_plan() -> None:
    from dsv4cp.kernels.indexer_topk import plan_seed

    # a CP 8 rank's r2 source (64K entries): every 128th column, its 20th largest (μ = 4)
    assert plan_seed(65536, 512, False, None, None) == (128, 20)
    assert plan_seed(16384, 512, False, None, None) == (32, 56)
    assert plan_seed(4095, 512, False, None, None) == (0, 0)  # stride < 8: none
    assert plan_seed(65536, 512, True, None, None) == (0, 0)  # a consumer: none
    assert plan_seed(65536, 512, False, 0, None) == (0, 0)  # turned off
    assert plan_seed(200, 16, False, 4, 1) == (4, 1)  # the knobs as given
    for bad in ((65536, 512, True, 64, None), (200, 16, False, -1, None), (200, 16, False, 4, 0)):
        with pytest.raises(ValueError, match="seed_stride"):
            plan_seed(*bad)


# ------------------------------------------------------------------ the cases (child process only)


def _cases() -> dict[str, object]:  # noqa: C901 - one namespace of small check functions
    import torch

    from dsv4cp import ops
    from dsv4cp.kernels import indexer_topk as kern
    from dsv4cp.ops import indexer_topk as ops_chunks

    def ints(*shape: int, lo: int = -2, hi: int = 3, seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(lo, hi, shape, generator=g).float()

    def inputs(t: int, h: int, d: int, n: int, seed: int):
        q, k = ints(t, h, d, seed=seed), ints(n, d, seed=seed + 1)
        pick = torch.randint(0, 4, (t, h), generator=torch.Generator().manual_seed(seed + 3))
        w = torch.tensor([0.5, -1.0, 2.0, 0.25])[pick]  # powers of two: exact products
        nv = torch.randint(0, n + 1, (t,), generator=torch.Generator().manual_seed(seed + 2))
        return q, w, k, nv

    def equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        if not torch.equal(got, want):
            bad = (got != want).any(1).nonzero().flatten()[:3].tolist()
            raise AssertionError(f"{what}: rows {bad} differ: {got[bad]} vs {want[bad]}")

    def full_one_piece():
        q, w, k, nv = inputs(37, 4, 16, 150, seed=1)
        nv[:5] = torch.tensor([150, 0, 8, 9, 1])  # n ≤ k, n = k, n = k + 1, nothing visible
        got, _ = kern.launch_mqa_topk(q, w, k, nv, 8, config=CFG)
        equal(got, ops.mqa_topk(q, w, k, nv, 8), "one piece")

    def full_pieces_and_cuts():
        q, w, k, nv = inputs(21, 4, 16, 300, seed=2)
        nv[0], nv[1] = 300, 299
        want = ops.mqa_topk(q, w, k, nv, 24)
        for pieces, cap in ((1, 64), (3, 64), (5, None)):  # cap 64: cuts every other tile
            got, _ = kern.launch_mqa_topk(q, w, k, nv, 24, config=CFG, pieces=pieces, cap=cap)
            equal(got, want, f"pieces={pieces} cap={cap}")

    def full_bf16_two_requests():
        q, w, k, nv = inputs(29, 4, 32, 160, seed=3)
        q, k = q.bfloat16(), k.bfloat16()  # small integers are exact in bf16
        ks = torch.cat([torch.zeros(11, dtype=torch.long), torch.full((18,), 50)])
        nv = torch.minimum(nv, 160 - ks)
        nv[12] = 500  # more visible than the width: the width bounds it
        for pieces in (None, 2):
            got, _ = kern.launch_mqa_topk(
                q, w, k, nv, 8, k_start=ks, width=96, config=CFG, pieces=pieces, cap=64
            )
            equal(got, ops.mqa_topk(q, w, k, nv, 8, k_start=ks, width=96), f"pieces={pieces}")

    def rising_logits_cut_every_tile():
        # Logits grow with the column: every column beats the threshold, the buffer is cut at
        # every tile, and the answer is the newest k of each row.
        t, h, d, n = 18, 4, 16, 200
        q = torch.ones(t, h, d)
        k = torch.arange(n, dtype=torch.float32)[:, None].expand(n, d) / 16
        w = torch.ones(t, h)
        nv = torch.randint(10, n + 1, (t,), generator=torch.Generator().manual_seed(8))
        got, _ = kern.launch_mqa_topk(q, w, k, nv, 16, config=CFG, cap=64)
        equal(got, ops.mqa_topk(q, w, k, nv, 16), "rising")
        newest = nv[:, None] - 16 + torch.arange(16)
        equal(got.long(), torch.where(nv[:, None] > 16, newest, got.long()), "newest k")

    def candidates():
        q, w, k, nv = inputs(33, 4, 16, 180, seed=4)
        ks = torch.cat([torch.zeros(20, dtype=torch.long), torch.full((13,), 30)])
        nv = torch.minimum(nv, 180 - ks)
        nv[:4] = torch.tensor([0, 1, 140, 149])  # 149 > width 141: the forced block is cut
        for pieces, width, max_blocks in ((None, 141, 6), (3, 141, 6), (2, 120, 40)):
            top, blocks = kern.launch_mqa_topk(
                q, w, k, nv, 8, k_start=ks, width=width, config=CFG, pieces=pieces, cap=64,
                block_size=4, max_blocks=max_blocks,
            )  # fmt: skip
            want_top, want_blocks = ops.mqa_topk_candidates(
                q, w, k, nv, 8, 4, max_blocks, k_start=ks, width=width
            )
            equal(top, want_top, f"top-k pieces={pieces}")
            equal(blocks, want_blocks, f"blocks pieces={pieces} max_blocks={max_blocks}")

    def consumer():
        q, w, k, nv = inputs(30, 4, 16, 160, seed=5)
        g = torch.Generator().manual_seed(6)
        ids = torch.randint(-1, 45, (30, 7), generator=g).int()  # ≥ 40 blocks: out of range
        ids[0] = torch.tensor([3, 3, 1, -1, 2, 2, 0])  # duplicates, unsorted
        ids[1] = -1  # no candidates at all
        nv[2] = 0
        for pieces in (None, 3):
            got, _ = kern.launch_mqa_topk(
                q, w, k, nv, 8, width=160, config=CFG, pieces=pieces, cap=64,
                block_ids=ids, block_size=4,
            )  # fmt: skip
            equal(got, ops.mqa_topk_among_blocks(q, w, k, nv, ids, 4, 8, width=160), "consumer")

    def consumer_gather():
        # Only the published blocks' keys are scored (one row per step, all heads in one product).
        q, w, k, nv = inputs(30, 4, 16, 160, seed=9)
        g = torch.Generator().manual_seed(10)
        ids = torch.randint(-1, 45, (30, 7), generator=g).int()
        ids[0] = torch.tensor([3, 3, 1, -1, 2, 2, 0])  # duplicates, unsorted
        ids[1] = -1
        ks = torch.cat([torch.zeros(10, dtype=torch.long), torch.full((20,), 20)])
        nv = torch.minimum(nv, 160 - ks)
        nv[3] = 0
        want = ops.mqa_topk_among_blocks(q, w, k, nv, ids, 4, 8, k_start=ks, width=140)
        for cap in (None, 64):  # 64: the buffer is cut every other tile
            got, _ = kern.launch_mqa_topk(
                q, w, k, nv, 8, k_start=ks, width=140, config=CFG, cap=cap,
                block_ids=ids, block_size=4, consumer="gather",
            )  # fmt: skip
            equal(got, want, f"gather cap={cap}")

    def qat_key_bits():
        # qat scores are bf16 values (many ties after rounding, both signs): the 16-bit search
        # (the default) and the 32-bit one select what the twin selects, with cuts (cap 64),
        # several pieces (their merge), the candidate source's blocks, the consumer's gather mode
        # and the logits route's selection.
        q, w, k, nv = inputs(27, 4, 16, 200, seed=11)
        q, k = q * 37, k * 29  # products beyond bf16's 8 bits: the roundings tie columns
        nv[:3] = torch.tensor([200, 0, 5])
        want = ops.mqa_topk(q, w, k, nv, 16, quant="qat")
        want_top, want_blocks = ops.mqa_topk_candidates(q, w, k, nv, 16, 4, 12, quant="qat")
        g = torch.Generator().manual_seed(12)
        ids = torch.randint(-1, 50, (27, 9), generator=g).int()
        want_among = ops.mqa_topk_among_blocks(q, w, k, nv, ids, 4, 16, quant="qat")
        for bits in (None, 16, 32):
            for pieces in (None, 3):
                got, _ = kern.launch_mqa_topk(
                    q, w, k, nv, 16, config=CFG, pieces=pieces, cap=64, quant="qat",
                    key_bits=bits,
                )  # fmt: skip
                equal(got, want, f"qat key_bits={bits} pieces={pieces}")
            top, blocks = kern.launch_mqa_topk(
                q, w, k, nv, 16, config=CFG, cap=64, quant="qat", key_bits=bits,
                block_size=4, max_blocks=12,
            )  # fmt: skip
            equal(top, want_top, f"qat candidates key_bits={bits}")
            equal(blocks, want_blocks, f"qat blocks key_bits={bits}")
            got, _ = kern.launch_mqa_topk(
                q, w, k, nv, 16, config=CFG, cap=64, quant="qat", key_bits=bits,
                block_ids=ids, block_size=4, consumer="gather",
            )  # fmt: skip
            equal(got, want_among, f"qat gather key_bits={bits}")
            got, _ = kern.launch_mqa_topk(q, w, k, nv, 16, quant="qat", key_bits=bits,
                                          route="logits")  # fmt: skip
            equal(got, want, f"qat logits route key_bits={bits}")

    def random_floats_tie_aware():
        g = torch.Generator().manual_seed(7)
        t, h, d, n, kk = 19, 4, 32, 220, 16
        q, w = torch.randn(t, h, d, generator=g), torch.randn(t, h, generator=g)
        k = torch.randn(n, d, generator=g)
        nv = torch.randint(0, n + 1, (t,), generator=g)
        got, _ = kern.launch_mqa_topk(q, w, k, nv, kk, config=CFG, pieces=2, cap=64)
        dots = torch.einsum("thd,nd->thn", q.double(), k.double())
        exact = (torch.relu(dots) * w.double()[..., None]).sum(1)
        for r in range(t):
            m = int(nv[r])
            picked = got[r][got[r] >= 0].long()
            assert len(picked) == min(m, kk) and torch.all(got[r][len(picked) :] == -1)
            assert torch.all(picked[1:] > picked[:-1]), "not ascending"
            if m > kk:
                chosen = torch.zeros(m, dtype=torch.bool)
                chosen[picked] = True
                row = exact[r, :m]
                assert row[chosen].min() >= row[~chosen].max() - 1e-4, "a larger logit was left out"

    def logits_route():
        # the plain top-k's other route (logits to memory in row chunks, then the selection
        # kernel), explicit and picked by width, two requests and a width bound included
        q, w, k, nv = inputs(29, 4, 32, 160, seed=11)
        ks = torch.cat([torch.zeros(11, dtype=torch.long), torch.full((18,), 50)])
        nv = torch.minimum(nv, 160 - ks)
        nv[12] = 500
        want = ops.mqa_topk(q, w, k, nv, 8, k_start=ks, width=96)
        got, blocks = kern.launch_mqa_topk(q, w, k, nv, 8, k_start=ks, width=96, route="logits")
        equal(got, want, "route=logits")
        assert blocks is None
        assert kern.pick_route("auto", 96, False) == "logits"
        equal(kern.mqa_topk(q, w, k, nv, 8, k_start=ks, width=96), want, "picked by width")
        budget = ops_chunks.LOGITS_BUDGET_BYTES
        try:  # a budget of one row per chunk: the chunks' results are concatenated in order
            ops_chunks.LOGITS_BUDGET_BYTES = 4 * 96
            equal(kern.launch_mqa_topk(q, w, k, nv, 8, k_start=ks, width=96, route="logits")[0],
                  want, "row chunks")  # fmt: skip
        finally:
            ops_chunks.LOGITS_BUDGET_BYTES = budget
        qat = ops.mqa_topk(q, w, k, nv, 8, quant="qat")
        equal(kern.launch_mqa_topk(q, w, k, nv, 8, quant="qat", route="logits")[0], qat, "qat")
        qb, kb = q.bfloat16(), k.bfloat16()  # small integers: int8-exact (indexer_logits_int8)
        for kk, width in ((None, None), (ks, 96)):
            got = kern.launch_mqa_topk(qb, w, kb, nv, 8, quant="qat", route="logits",
                                       int8_logits=True, k_start=kk, width=width)[0]  # fmt: skip
            want = ops.mqa_topk(qb, w, kb, nv, 8, quant="qat", k_start=kk, width=width)
            equal(got, want, f"qat on int8 MMAs, k_start={kk is not None}")
        # The route leaves the logits past n_visible unwritten (fill=False): the visible ones are
        # fill=True's, and the selection never reads the others (+inf there changes nothing).
        from dsv4cp.kernels.indexer_logits import launch_mqa_logits
        from dsv4cp.kernels.topk import launch_topk

        for kk, width, cfg in ((ks, 96, CFG), (None, None, CFG), (None, None, None)):
            full = launch_mqa_logits(q, w, k, nv, k_start=kk, width=width, config=cfg)
            part = launch_mqa_logits(q, w, k, nv, k_start=kk, width=width, config=cfg, fill=False)
            seen = torch.arange(full.shape[1])[None, :] < nv[:, None]
            assert torch.equal(part[seen], full[seen]), f"fill=False k_start={kk is not None}"
            assert torch.all(full[~seen] == float("-inf"))
            poisoned = full.masked_fill(~seen, float("inf"))
            want = ops.mqa_topk(q, w, k, nv, 8, k_start=kk, width=width)
            equal(launch_topk(poisoned, nv, 8), want, "the selection read a hidden logit")
        equal(kern.launch_mqa_topk(q, w, k, nv, 8, route="logits", fill_logits=True)[0],
              ops.mqa_topk(q, w, k, nv, 8), "fill_logits=True")  # fmt: skip

    def pieces_merged_raw_or_cut():
        # Several pieces: their running buffers go to the merge as they are when pieces · cap
        # fit MAX_MERGE (the default here), else after a last cut each (MAX_MERGE 0 forces it).
        # Both select what the twin selects: qat ties (both signs), the candidate source's top-k
        # and blocks, the consumer's map mode; cap 64 cuts in the middle of the pieces.
        q, w, k, nv = inputs(27, 4, 16, 200, seed=13)
        q, k = q * 37, k * 29  # products beyond bf16's 8 bits: the roundings tie columns
        nv[:3] = torch.tensor([200, 0, 5])
        ids = torch.randint(-1, 50, (27, 9), generator=torch.Generator().manual_seed(14)).int()
        want = ops.mqa_topk(q, w, k, nv, 16, quant="qat")
        want_top, want_blocks = ops.mqa_topk_candidates(q, w, k, nv, 16, 4, 12, quant="qat")
        want_among = ops.mqa_topk_among_blocks(q, w, k, nv, ids, 4, 16, quant="qat")
        merge_max = kern.MAX_MERGE
        try:
            for most in (merge_max, 0):
                kern.MAX_MERGE = most
                for pieces in (2, 3):
                    kw = dict(config=CFG, pieces=pieces, cap=64, quant="qat")
                    got, _ = kern.launch_mqa_topk(q, w, k, nv, 16, **kw)
                    equal(got, want, f"MAX_MERGE={most} pieces={pieces}")
                    top, blocks = kern.launch_mqa_topk(
                        q, w, k, nv, 16, block_size=4, max_blocks=12, **kw
                    )
                    equal(top, want_top, f"candidates MAX_MERGE={most} pieces={pieces}")
                    equal(blocks, want_blocks, f"blocks MAX_MERGE={most} pieces={pieces}")
                    got, _ = kern.launch_mqa_topk(
                        q, w, k, nv, 16, block_ids=ids, block_size=4, consumer="map", **kw
                    )
                    equal(got, want_among, f"consumer MAX_MERGE={most} pieces={pieces}")
        finally:
            kern.MAX_MERGE = merge_max

    def seeded_scan_and_redo():
        # The seed (the rank-th largest of every 4th visible column's key) with one piece (the
        # direct write) and several (the merge), two requests, qat ties, the candidate source:
        # the twin's selection. Rank 1 (the sample's largest: most rows keep fewer than K keys)
        # shows the redo of short rows; without the redo that run must differ from the twin.
        q, w, k, nv = inputs(27, 4, 16, 200, seed=17)
        q, k = q * 37, k * 29
        nv[:4] = torch.tensor([200, 0, 5, 17])
        ks = torch.cat([torch.zeros(13, dtype=torch.long), torch.full((14,), 40)])
        nv = torch.minimum(nv, 200 - ks)
        want = ops.mqa_topk(q, w, k, nv, 16, k_start=ks, width=160, quant="qat")
        want_top, want_blocks = ops.mqa_topk_candidates(
            q, w, k, nv, 16, 4, 12, k_start=ks, width=160, quant="qat"
        )
        for rank in (None, 1):
            for pieces in (1, 3):
                kw = dict(config=CFG, pieces=pieces, cap=64, quant="qat", seed_stride=4,
                          seed_rank=rank, k_start=ks, width=160)  # fmt: skip
                got, _ = kern.launch_mqa_topk(q, w, k, nv, 16, **kw)
                equal(got, want, f"seed rank={rank} pieces={pieces}")
                top, blocks = kern.launch_mqa_topk(q, w, k, nv, 16, block_size=4, max_blocks=12,
                                                   **kw)  # fmt: skip
                equal(top, want_top, f"candidates seed rank={rank} pieces={pieces}")
                equal(blocks, want_blocks, f"blocks seed rank={rank} pieces={pieces}")
        try:
            kern.SEED_REDO = False
            for pieces in (1, 3):
                kw = dict(config=CFG, pieces=pieces, cap=64, quant="qat", seed_stride=4,
                          seed_rank=1, k_start=ks, width=160)  # fmt: skip
                got, _ = kern.launch_mqa_topk(q, w, k, nv, 16, **kw)
                assert not torch.equal(got, want), f"the seed pruned nothing (pieces={pieces})"
                short = (got < 0).sum(1) > (16 - nv.clamp(0, 160)).clamp_min(0)
                assert short.any(), "no row was left short without the redo"
        finally:
            kern.SEED_REDO = True
        with pytest.raises(ValueError, match="seed_stride"):
            kern.launch_mqa_topk(q, w, k, nv, 16, config=CFG, seed_stride=-1)

    # int8_scan: the scan's qat logits on int8 MMAs (indexer_logits_int8's head loop, tile by
    # tile) must select what the bf16 scan and the twin select, bit for bit, on fake-fp4 inputs.
    from dsv4cp.ops.attention_quant import fake_quant_index_fp4

    def fp4_inputs(t: int, h: int, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        q = fake_quant_index_fp4(torch.randn(t, h, 128, generator=g)).bfloat16()
        k = fake_quant_index_fp4(torch.randn(n, 128, generator=g)).bfloat16()
        w = torch.randn(t, h, generator=g) / h
        nv = torch.randint(0, n + 1, (t,), generator=g)
        return q, w, k, nv

    def int8_equal(q, w, k, nv, k_top: int, what: str, want=None, **kw):
        """int8_scan=True against int8_scan=False (and `want`, the twin's): (top-k, blocks)."""
        got = kern.launch_mqa_topk(q, w, k, nv, k_top, quant="qat", int8_scan=True, **kw)
        ref = kern.launch_mqa_topk(q, w, k, nv, k_top, quant="qat", int8_scan=False, **kw)
        equal(got[0], ref[0], f"int8 scan {what}")
        if ref[1] is not None:
            equal(got[1], ref[1], f"int8 scan blocks {what}")
        if want is not None:
            equal(got[0], want, f"int8 scan against the twin {what}")
        return got

    def int8_scan_plain():
        q, w, k, nv = fp4_inputs(37, 4, 150, seed=21)
        nv[:4] = torch.tensor([150, 0, 8, 9])
        want = ops.mqa_topk(q, w, k, nv, 8, quant="qat")
        for pieces, cap in ((None, None), (3, 64)):  # cap 64: cuts; 3 pieces: the merge
            kw = dict(config=CFG, pieces=pieces, cap=cap, route="scan")
            int8_equal(q, w, k, nv, 8, f"pieces={pieces}", want, **kw)
        from dsv4cp.kernels import indexer_logits_int8 as int8

        shipped = int8.SCAN_CONVERT, int8.SCAN_RELU_FMA
        try:  # the other conversion of the int32 sums (relu_fma: GPU only)
            int8.SCAN_CONVERT = "magic" if shipped[0] == "cvt" else "cvt"
            int8_equal(q, w, k, nv, 8, f"convert={int8.SCAN_CONVERT}", want, config=CFG,
                       route="scan")  # fmt: skip
        finally:
            int8.SCAN_CONVERT, int8.SCAN_RELU_FMA = shipped
        # the control: the int8 path is the one taken (a wrong key scale changes the selection)
        encode = kern.encode_int8

        def wrong_scale(x: torch.Tensor, *a: object):
            codes, scale, ok = encode(x, *a)
            return codes, scale * (1 + (torch.arange(len(scale)) % 2)), ok

        try:
            kern.encode_int8 = wrong_scale
            got, _ = kern.launch_mqa_topk(q, w, k, nv, 8, config=CFG, quant="qat", int8_scan=True)
        finally:
            kern.encode_int8 = encode
        assert not torch.equal(got, want), "the int8 scan did not take the keys' scales"
        # the knob's default (SCAN_INT8) and a non-bf16 q (no int8: the bf16 scan's selection)
        equal(kern.launch_mqa_topk(q, w, k, nv, 8, config=CFG, quant="qat")[0], want, "default")
        got, _ = kern.launch_mqa_topk(q.float(), w, k.float(), nv, 8, config=CFG, quant="qat",
                                      int8_scan=True)  # fmt: skip
        equal(got, want, "fp32 q")

    def int8_scan_candidates_and_consumer():
        # two requests in one row block (k_start segments), the candidate source's blocks and
        # the consumer's map mode, one piece and several
        q, w, k, nv = fp4_inputs(29, 4, 180, seed=22)
        ks = torch.cat([torch.zeros(11, dtype=torch.long), torch.full((18,), 30)])
        nv = torch.minimum(nv, 180 - ks)
        nv[:3] = torch.tensor([0, 1, 149])
        ids = torch.randint(-1, 40, (29, 7), generator=torch.Generator().manual_seed(23)).int()
        want = ops.mqa_topk(q, w, k, nv, 8, k_start=ks, width=141, quant="qat")
        want_among = ops.mqa_topk_among_blocks(q, w, k, nv, ids, 4, 8, k_start=ks, width=141,
                                               quant="qat")  # fmt: skip
        for pieces in (None, 3):
            kw = dict(config=CFG, pieces=pieces, cap=64, k_start=ks, width=141)
            int8_equal(q, w, k, nv, 8, f"plain k_start pieces={pieces}", want, route="scan", **kw)
            int8_equal(q, w, k, nv, 8, f"source pieces={pieces}", want, block_size=4,
                       max_blocks=6, **kw)  # fmt: skip
            int8_equal(q, w, k, nv, 8, f"consumer pieces={pieces}", want_among, block_ids=ids,
                       block_size=4, consumer="map", **kw)  # fmt: skip
        # the gather consumer keeps its bf16 kernel: the knob changes nothing there
        int8_equal(q, w, k, nv, 8, "gather", want_among, block_ids=ids, block_size=4,
                   consumer="gather", config=CFG, k_start=ks, width=141)  # fmt: skip

    def int8_scan_seeded():
        # the seed's sample (a column stride), the seeded pass and the redo (rank 1 leaves rows
        # short), with k_start; then a width of 4K, where plan_seed plans the seed itself
        q, w, k, nv = fp4_inputs(27, 4, 200, seed=24)
        ks = torch.cat([torch.zeros(13, dtype=torch.long), torch.full((14,), 40)])
        nv = torch.minimum(nv, 200 - ks)
        nv[:4] = torch.tensor([200, 0, 5, 17])
        want = ops.mqa_topk(q, w, k, nv, 16, k_start=ks, width=160, quant="qat")
        for rank in (None, 1):
            for pieces in (1, 3):
                kw = dict(config=CFG, pieces=pieces, cap=64, seed_stride=4, seed_rank=rank,
                          k_start=ks, width=160)  # fmt: skip
                int8_equal(q, w, k, nv, 16, f"seed rank={rank} pieces={pieces}", want, **kw)
                int8_equal(q, w, k, nv, 16, f"seeded source rank={rank} pieces={pieces}",
                           block_size=4, max_blocks=12, **kw)  # fmt: skip
        from dsv4cp.kernels.indexer_topk_plan import plan_seed

        q, w, k, nv = fp4_inputs(16, 2, 4096, seed=25)
        nv[:2] = torch.tensor([4096, 3000])
        assert plan_seed(4096, 16, False, None, None)[0] > 1
        kw = dict(config=(16, 128, 4, 1), route="scan")
        int8_equal(q, w, k, nv, 16, "width 4K", ops.mqa_topk(q, w, k, nv, 16, quant="qat"), **kw)

    def int8_scan_fallback_tiles():
        # vectors the encoding cannot hold: their tiles take the bf16 steps in the int8 launch
        from dsv4cp.kernels.indexer_logits_int8 import encode_int8

        q, w, k, nv = fp4_inputs(40, 8, 160, seed=26)
        k[9] *= 4.0  # a key most rows select or drop, whose codes (zeros) cannot be used
        k[9, 32:64] *= 2.0**-9  # a block 2^9 below the key's largest: not n · 2^E
        q[22, 4, 32:64] *= 2.0**-9  # a head the int8 path would drop (rows 0-15: all usable)
        q[30, 4] *= 2.0**-40  # E < -30; and a weight below 2^-30
        w[20, 1] = 2.0**-35
        ks = torch.cat([torch.zeros(24, dtype=torch.long), torch.full((16,), 20)])
        nv = torch.minimum(nv, 160 - ks)
        nv[:4] = 140
        assert encode_int8(k)[2][9].item() == 0
        assert encode_int8(q, w)[2][[20, 22, 30]].tolist() == [0, 0, 0]
        want = ops.mqa_topk(q, w, k, nv, 8, k_start=ks, width=140, quant="qat")
        for pieces in (None, 2):
            kw = dict(config=CFG, pieces=pieces, cap=64, k_start=ks, width=140)
            int8_equal(q, w, k, nv, 8, f"fallback pieces={pieces}", want, route="scan", **kw)
            int8_equal(q, w, k, nv, 8, f"fallback source pieces={pieces}", block_size=4,
                       max_blocks=6, **kw)  # fmt: skip

    return {name: fn for name, fn in locals().items() if name in CASES}


if __name__ == "__main__":
    report_cases(_cases(), sys.argv[1:])
