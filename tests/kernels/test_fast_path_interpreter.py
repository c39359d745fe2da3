"""The layer's fast-path kernels on the CPU through Triton's interpreter, against the ops twins.

- `kv_decode.decode_gather`: chosen cache rows of every storage format decoded into a dense
  workspace, bit for bit `ops.kv_format.decode_rows` (rows with −1 untouched);
- `attention_workspace.build_workspace` with that Triton decode (what the CUDA path runs);
- `workspace_rows.mark_rows` / `place_rows` / `remap_rows` (the workspace's row numbering) bit
  for bit `ops.workspace_rows`: −1, out-of-range and repeated indices, int32 and int64, a row
  slice, a column slice of the output, a bound below, at and above the count (`place_rows` also
  against its definition: the i-th marked row, then −1; and over several programs), and
  `remap_rows` in `build_workspace`'s forms (the inclusive count, base − 1, bound + 1; a dense
  row list's `invert_rows`, against its definition);
- `indexer_topk_cached.mqa_topk_cached` (the layer's index node: the index cache's rows decoded
  into a workspace, then the fused scan, or for a plain top-k this narrow the logits route:
  every plain case runs both, `routes()`) against `ops.mqa_topk_cached`, in both numerics and
  the three roles (full top-k, candidate source, candidate consumer with the map and the gather
  kernel), two requests (two k_start). Under qat the keys are real fp4 rows and the queries
  fake-fp4 values, as the layer has them; the dots are fp32 (the interpreter), the fp4 products
  exact, so the bf16 scores and the selections must be identical, ties (frequent after bf16
  rounding) broken toward the smaller index.

TRITON_INTERPRET must be set before triton is imported: the cases run in a child process (this
file as a script) and report back as JSON.
"""

from __future__ import annotations

import sys

import pytest

from tests.kernels.interpreter_child import report_cases, run_interpreter_cases

CASES = (
    "decode_gather_every_format",
    "workspace_with_the_triton_decode",
    "workspace_rows_twins",
    "topk_cached_none_dense",
    "topk_cached_qat_full",
    "topk_cached_qat_candidates",
    "topk_cached_qat_consumer",
    "qat_rounding_decides_ties",
    "rope_tail_in_place",
    "fused_equals_the_cached_logits_kernel",
)


@pytest.fixture(scope="module")
def child_results() -> dict[str, str]:
    return run_interpreter_cases(__file__, CASES)


@pytest.mark.parametrize("case", CASES)
def test_fast_path_in_the_interpreter(case: str, child_results: dict[str, str]) -> None:
    assert child_results[case] == "ok", child_results[case]


# ------------------------------------------------------------------ the cases (child process only)


def _cases() -> dict[str, object]:  # noqa: C901 - one namespace of small check functions
    import torch

    from dsv4cp import ops
    from dsv4cp.kernels import attention_workspace
    from dsv4cp.kernels import indexer_topk as kern  # the launcher; pick_route reads its limit
    from dsv4cp.kernels import indexer_topk_cached as kern_cached
    from dsv4cp.kernels.kv_decode import decode_gather
    from dsv4cp.ops.attention_quant import fake_quant_index_fp4
    from dsv4cp.ops.kv_format import decode_rows, encode_rows

    g = torch.Generator().manual_seed(0)

    def equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        if not torch.equal(got, want):
            bad = (got != want).reshape(got.shape[0], -1).any(1).nonzero().flatten()[:3].tolist()
            raise AssertionError(f"{what}: rows {bad} differ: {got[bad]} vs {want[bad]}")

    def decode_gather_every_format():
        for fmt, d in (("fp8_ue8m0_32", 64), ("fp4_e4m3_16", 96), ("fp4_ue8m0_32", 64)):
            x = torch.randn(40, d, generator=g) * torch.rand(40, 1, generator=g) * 8
            rows = encode_rows(x, fmt, dense_dtype=torch.bfloat16)
            src = torch.tensor([3, -1, 0, 39, 3, 17, -1], dtype=torch.int32)
            for dtype in (torch.bfloat16, torch.float32):
                out = torch.full((9, d), 7.0, dtype=dtype)
                decode_gather(rows, src, fmt, d, out)
                want = decode_rows(rows, fmt, d)
                keep = src >= 0
                equal(out[:7][keep].float(), want[src[keep].long()], f"{fmt} {dtype}")
                assert torch.all(out[:7][~keep] == 7) and torch.all(out[7:] == 7), "untouched"
        dense = torch.randn(12, 32, generator=g).bfloat16()
        out = torch.zeros(3, 32, dtype=torch.bfloat16)
        decode_gather(dense, torch.tensor([11, 0, 5]), "dense", 32, out)
        equal(out, dense[[11, 0, 5]], "dense")

    def workspace_with_the_triton_decode():
        d = 64
        swa = encode_rows(
            torch.randn(30, d, generator=g), "fp8_ue8m0_32", dense_dtype=torch.bfloat16
        )
        comp = encode_rows(
            torch.randn(20, d, generator=g), "fp4_e4m3_16", dense_dtype=torch.bfloat16
        )
        win = torch.randint(-1, 30, (5, 8), generator=g)
        top = torch.randint(-1, 20, (5, 6), generator=g)
        src = attention_workspace.workspace_sources(
            swa, win, comp, top, "fp8_ue8m0_32", "fp4_e4m3_16", None
        )
        kv, idx = attention_workspace.build_workspace(src, slice(1, 4), d, torch.bfloat16)
        keys = torch.cat([decode_rows(swa, "fp8_ue8m0_32", d), decode_rows(comp, "fp4_e4m3_16", d)])
        both = torch.cat([win, torch.where(top >= 0, top + 30, -1)], 1)[1:4]
        v = both >= 0
        equal(idx >= 0, v, "valid")
        equal(kv[idx[v].long()].float(), keys[both[v]], "rows")

    def workspace_rows_twins():
        from dsv4cp.kernels import workspace_rows as kern_rows
        from dsv4cp.ops import workspace_rows as ops_rows

        for dtype, n, bound in ((torch.int32, 50, 1000), (torch.int64, 300, 40)):
            full = torch.randint(-3, n + 4, (23, 150), generator=g).to(dtype)
            full[3, :20] = 7  # one row named many times
            idx = full[2:21]  # a row slice: stride 150
            marks = [torch.zeros(n, dtype=torch.int32) for _ in range(2)]
            kern_rows.mark_rows(idx, marks[0])
            ops_rows.mark_rows(idx, marks[1])
            equal(marks[0], marks[1], f"mark {dtype}")
            count = torch.cumsum(marks[0], 0, dtype=torch.int32)
            number = count - 1
            total = int(count[-1])
            for b in (bound, total, total // 2, total + 9):  # more, as many and fewer rows
                srcs = [torch.full((b,), 77, dtype=torch.int32) for _ in range(2)]
                kern_rows.place_rows(count, srcs[0])
                ops_rows.place_rows(count, srcs[1])
                equal(srcs[0], srcs[1], f"place {dtype} bound {b}")
                marked = marks[0].nonzero().flatten().int()  # the definition: i-th marked row
                want = torch.full((b,), -1, dtype=torch.int32)
                want[: min(b, total)] = marked[:b]
                equal(srcs[1], want, f"place twin {dtype} bound {b}")
            outs = [torch.full((19, 170), 5, dtype=torch.int32) for _ in range(3)]
            kern_rows.remap_rows(idx, number, outs[0][:, 10:160], 64, bound)
            ops_rows.remap_rows(idx, number, outs[1][:, 10:160], 64, bound)
            equal(outs[0], outs[1], f"remap {dtype}")  # the columns outside untouched too
            assert bool((outs[0][:, 10:160] == -1).any()) and bool((outs[0] >= 64).any())
            # build_workspace's form: the inclusive count, base − 1 and bound + 1
            kern_rows.remap_rows(idx, count, outs[2][:, 10:160], 63, bound + 1)
            equal(outs[2], outs[0], f"remap by count {dtype}")
            # the dense form: a shuffled row list (some rows left out), inverted
            listed = torch.randperm(n, generator=g)[: n - 7].int()
            inv = ops_rows.invert_rows(listed, n)
            dense = [torch.full((19, 170), 5, dtype=torch.int32) for _ in range(2)]
            kern_rows.remap_rows(idx, inv, dense[0][:, 10:160], 64, n - 7)
            ops_rows.remap_rows(idx, inv, dense[1][:, 10:160], 64, n - 7)
            equal(dense[0], dense[1], f"remap dense {dtype}")
            place = torch.full((n + 10,), -1, dtype=torch.int64)
            place[listed.long()] = torch.arange(n - 7) + 64
            v = (idx >= 0) & (idx < n)
            want = torch.where(v, place[idx.long().clamp(0, n - 1)], -1).int()
            equal(dense[0][:, 10:160], want, f"remap dense definition {dtype}")
        # several programs (n and bounds above PLACE_BLOCK): the total read by a program that
        # does not hold the last count, and the −1 fill in programs past n
        n = 5000
        mark = (torch.rand(n, generator=g) < 0.4).int()
        count = torch.cumsum(mark, 0, dtype=torch.int32)
        total = int(count[-1])
        for b in (total - 700, total, total + 1500, n + 900):
            srcs = [torch.full((b,), 77, dtype=torch.int32) for _ in range(2)]
            kern_rows.place_rows(count, srcs[0])
            ops_rows.place_rows(count, srcs[1])
            equal(srcs[0], srcs[1], f"place n {n} bound {b}")
            want = torch.full((b,), -1, dtype=torch.int32)
            want[: min(b, total)] = mark.nonzero().flatten().int()[:b]
            equal(srcs[0], want, f"place definition n {n} bound {b}")

    def index_inputs(t: int, h: int, d: int, n: int, qat: bool, seed: int):
        gg = torch.Generator().manual_seed(seed)
        q = torch.randn(t, h, d, generator=gg)
        w = torch.randn(t, h, generator=gg)
        k = torch.randn(n, d, generator=gg)
        if qat:  # the layer's qat inputs: fake-fp4 queries, fp4 key rows
            q = fake_quant_index_fp4(q)
            cache = encode_rows(k, "fp4_ue8m0_32", dense_dtype=torch.bfloat16)
            fmt = "fp4_ue8m0_32"
        else:
            q, w = q.round(), w.sign() * 2.0 ** torch.randint(-2, 2, (t, h), generator=gg)
            cache, fmt = k.round(), "dense"  # integers, powers of two: exact in any order
        # the workspace entries: a permutation of the cache rows (rows = entry_rows(slots))
        rows = torch.randperm(n, generator=gg)
        ks = torch.cat([torch.zeros(t // 2, dtype=torch.long), torch.full((t - t // 2,), 40)])
        nv = torch.randint(0, n - 40 + 1, (t,), generator=gg)
        nv[0], nv[1] = 0, 3
        return q, w, cache, rows, nv, ks, fmt

    def routes():
        """The plain top-k's two routes in turn (`indexer_topk.pick_route` by width and rows):
        the scan (no width is narrow enough, no row count large enough), then the logits route
        (every width is)."""
        limit, per_row = kern.LOGITS_ROUTE_MAX_WIDTH, kern.LOGITS_ROUTE_KEYS_PER_ROW
        try:
            for name, value in (("scan", 0), ("logits", 1 << 30)):
                kern.LOGITS_ROUTE_MAX_WIDTH, kern.LOGITS_ROUTE_KEYS_PER_ROW = value, value
                yield name
        finally:
            kern.LOGITS_ROUTE_MAX_WIDTH, kern.LOGITS_ROUTE_KEYS_PER_ROW = limit, per_row

    def run_both(qat: bool, seed: int, **kw: object):
        q, w, cache, rows, nv, ks, fmt = index_inputs(23, 4, 64, 170, qat, seed)
        quant = "qat" if qat else "none"
        common = dict(k_start=ks, width=130, k_format=fmt, quant=quant)
        want = ops.mqa_topk_cached(q, w, cache, rows, nv, 8, **common, **kw)  # type: ignore[arg-type]
        got = kern_cached.mqa_topk_cached(q, w, cache, rows, nv, 8, **common, **kw)  # type: ignore[arg-type]
        return got, want, (q, w, cache, rows, nv, ks, fmt)

    def topk_cached_none_dense():
        for route in routes():
            got, want, _ = run_both(False, 1)
            equal(got[0], want[0], f"top-k, {route}")
            assert got[1] is None and want[1] is None

    def topk_cached_qat_full():
        for route in routes():
            got, want, (q, w, cache, rows, nv, ks, fmt) = run_both(True, 2)
            equal(got[0], want[0], f"qat top-k, {route}")
        # and the launcher's knobs: several pieces, buffer cuts
        keys = decode_rows(cache[rows], fmt, 64)
        for pieces, cap in ((3, 64), (None, None)):
            top, _ = kern.launch_mqa_topk(
                q, w, keys, nv, 8, k_start=ks, width=130, quant="qat",
                config=(16, 32, 4, 1), pieces=pieces, cap=cap,
            )  # fmt: skip
            equal(top, want[0], f"qat pieces={pieces}")

    def topk_cached_qat_candidates():
        got, want, _ = run_both(True, 3, block_size=4, max_blocks=5)
        equal(got[0], want[0], "qat top-k (source)")
        assert got[1] is not None and want[1] is not None
        equal(got[1], want[1], "qat candidate blocks")

    def topk_cached_qat_consumer():
        ids = torch.randint(-1, 34, (23, 6), generator=torch.Generator().manual_seed(5)).int()
        ids[2] = torch.tensor([3, 3, 1, -1, 2, 0])
        for consumer in ("map", "gather"):
            q, w, cache, rows, nv, ks, fmt = index_inputs(23, 4, 64, 170, True, 4)
            keys = decode_rows(cache[rows], fmt, 64)
            want = ops.mqa_topk_cached(
                q, w, cache, rows, nv, 8, k_start=ks, width=130, k_format=fmt, quant="qat",
                block_size=4, block_ids=ids,
            )[0]  # fmt: skip
            got, _ = kern.launch_mqa_topk(
                q, w, keys, nv, 8, k_start=ks, width=130, quant="qat", block_ids=ids,
                block_size=4, consumer=consumer, config=(16, 32, 4, 1),
            )  # fmt: skip
            equal(got, want, f"qat consumer {consumer}")
        got2, _, _ = run_both(True, 4, block_size=4, block_ids=ids)
        equal(got2[0], want, "mqa_topk_cached consumer")

    def qat_rounding_decides_ties():
        # scores 252 + δ (δ ∈ {0, 1.5, 2, 3}): fp32 tells 1.5 from 2, bf16 does not (253.5 and
        # 254 both round to 254), so the cut inside that group goes to the larger δ in fp32 and
        # to the smaller indices under qat
        n, d = 96, 64
        gg = torch.Generator().manual_seed(11)
        delta = torch.zeros(n)
        perm = torch.randperm(n, generator=gg)
        delta[perm[:2]], delta[perm[2:12]], delta[perm[12:22]] = 3.0, 2.0, 1.5
        k = torch.full((n, d), 4.0)
        k[:, 0] = delta
        cache = encode_rows(k, "fp4_ue8m0_32", dense_dtype=torch.bfloat16)
        equal(decode_rows(cache, "fp4_ue8m0_32", d), k, "fp4 keys exact")
        q = torch.ones(5, 4, d)
        w = torch.full((5, 4), 0.25)
        nv = torch.full((5,), n)
        rows = torch.arange(n)
        args = (q, w, cache, rows, nv, 8)
        kw = dict(k_format="fp4_ue8m0_32", block_size=4)
        want = ops.mqa_topk_cached(*args, quant="qat", **kw)[0]  # type: ignore[arg-type]
        fp32 = ops.mqa_topk_cached(*args, quant="none", **kw)[0]  # type: ignore[arg-type]
        assert not torch.equal(want, fp32), "the case must tell the numerics apart"
        for quant, ref in (("qat", want), ("none", fp32)):
            for route in routes():
                got = kern_cached.mqa_topk_cached(*args, quant=quant, **kw)[0]  # type: ignore[arg-type]
                equal(got, ref, f"{quant} ties, {route}")
            blocks = torch.arange(n // 4).expand(5, -1).int()
            got = kern.launch_mqa_topk(
                q, w, k, nv, 8, quant=quant, block_ids=blocks, block_size=4, consumer="gather"
            )[0]  # fmt: skip
            equal(got, ref, f"{quant} ties, gather")

    def rope_tail_in_place():
        from dsv4cp.kernels.rope import rope_tail_
        from dsv4cp.rope_scaling import YarnScaling

        yarn = YarnScaling(factor=16.0, original_max_position=4096, beta_fast=32, beta_slow=1)
        pos = torch.tensor([0, 5, 40000, 7, 1_000_000, 3])
        for shape, dtype, inverse, y in (
            ((6, 4, 96), torch.bfloat16, False, None),
            ((6, 4, 96), torch.bfloat16, True, yarn),
            ((6, 64), torch.float32, True, yarn),
        ):
            x = torch.randn(*shape, generator=g).to(dtype)
            want = ops.rope_tail_(x.clone(), pos, 32, 10000.0, y, inverse)
            got = x.clone()
            ptr = got.data_ptr()
            out = rope_tail_(got, pos, 32, 10000.0, y, inverse)
            assert out is got and got.data_ptr() == ptr, "in place"
            equal(got[..., :-32], x[..., :-32], "the head of each row is untouched")
            tol = 1e-5 if dtype == torch.float32 else 2**-7  # the interpreter's cos/sin
            diff = (got.float() - want.float()).abs().max().item()
            assert diff <= tol * max(1.0, want.float().abs().max().item()), (shape, diff)
        # a view whose rows are not contiguous goes through a copy, still in place
        base = torch.randn(4, 6, 64, generator=g)
        view = base.transpose(0, 1)  # [6, 4, 64]
        want = ops.rope_tail_(view.clone(), pos, 32, 10000.0)
        rope_tail_(view, pos, 32, 10000.0)
        assert (view - want).abs().max().item() <= 1e-5

    def fused_equals_the_cached_logits_kernel():
        # the unfused GPU path the layer had: the cached-logits kernel, then the selection kernel
        from dsv4cp.kernels.indexer_logits_cached import mqa_logits_cached
        from dsv4cp.kernels.topk import topk_indices

        for qat in (True, False):
            q, w, cache, rows, nv, ks, fmt = index_inputs(20, 4, 64, 150, qat, 21)
            quant = "qat" if qat else "none"
            logits = mqa_logits_cached(q, w, cache, rows, nv, width=150, k_format=fmt, quant=quant)
            want = topk_indices(logits, nv, 8)
            for route in routes():
                got = kern_cached.mqa_topk_cached(
                    q, w, cache, rows, nv, 8, width=150, k_format=fmt, quant=quant
                )
                equal(got[0], want, f"{route} vs cached kernel, {quant}")

    return {name: fn for name, fn in locals().items() if name in CASES}


if __name__ == "__main__":
    report_cases(_cases(), sys.argv[1:])
