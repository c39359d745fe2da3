"""kernels/rowwise (the row-local fp32 GEMMs: the MoE gate, mHC's mix logits with the rms scale
folded in) against their ops twins under Triton's interpreter (a child process), and compiled
for sm_90 here. The GPU comparison at Flash dims runs in tests/gpu (`-m gpu`).

Two properties. Row locality, exact: a row's output has the same bits whatever rows share the
call (sliced, strided, one row alone) — what CP = N equals CP = 1 rests on. Agreement with the
twin to the fp32 order bound: both sum fp32 products in different orders, so |kernel − twin| ≤
(2·K·2⁻²⁴ + 2⁻²⁰)·Σ_k |x_k·w_k| (each order's error is at most (K−1)·u·Σ|terms|; 2⁻²⁰ per
product covers the kernel's three-TF32 product, whose dropped x_lo·w_lo term and rounded low
parts are each below 2⁻²²), and for the mix logits that bound times the rms scale plus 4 ulps of
the result for the scale itself (Σx² summed in two orders, a divide, a square root). The
interpreter computes tl.dot in plain fp32, so the three-TF32 part is exercised on the GPU
(tests/gpu/test_rowwise_kernel.py) with the same bound."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.kernels.interpreter_child import report_cases, run_interpreter_cases

CASES = ["linear_within_order_bound", "rows_are_local", "mix_logits_within_bound", "edges"]


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    return run_interpreter_cases(__file__, CASES)


@pytest.mark.parametrize("case", CASES)
def test_rowwise_kernels_in_the_interpreter(case: str, results: dict[str, str]) -> None:
    assert results[case] == "ok", results[case]


def test_bad_input_is_named() -> None:
    from dsv4cp.kernels.rowwise import hc_mix_logits, rowwise_linear_fp32

    with pytest.raises(ValueError, match="rowwise_linear_fp32"):
        rowwise_linear_fp32(torch.zeros(3, 8), torch.zeros(4, 7))
    with pytest.raises(ValueError, match="hc_mix_logits"):
        hc_mix_logits(torch.zeros(3, 4, 8), torch.zeros(24, 31), norm_eps=1e-6)
    with pytest.raises(ValueError, match="take"):
        rowwise_linear_fp32(torch.zeros(3, 8, dtype=torch.float64), torch.zeros(4, 8))


def test_compiles_for_sm90() -> None:
    pytest.importorskip("triton")
    from dsv4cp.kernels.rowwise import PRECISION, _rowwise_kernel, tiles
    from tests.kernels.test_indexer_topk_compile import _compile

    for name in ("bf16", "fp32"):
        for rms, n in ((False, 384), (True, 24)):
            bm, bn, bk = tiles(n)
            const = dict(RMS=rms, BM=bm, BN=bn, BK=bk, PREC=PRECISION)
            types = [f"*{name}", "*fp32", "*fp32"] + ["i32"] * 6 + ["fp32"]
            _compile(_rowwise_kernel, types, const, 4, 3)


# ------------------------------------------------------------------ the cases (child process only)


def _order_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    k = x.shape[-1]
    return (2 * k * 2.0**-24 + 2.0**-20) * (x.double().abs() @ w.double().abs().t())


def _cases() -> dict[str, object]:
    from dsv4cp.kernels import rowwise as kernel
    from dsv4cp.ops import hyper_connections as ops_hc
    from dsv4cp.ops import rowwise as ops_rw

    def within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
        assert got.shape == want.shape and got.dtype == want.dtype == torch.float32
        err = (got.double() - want.double()).abs()
        assert bool((err <= bound).all()), float((err - bound).max())

    def linear_within_order_bound() -> None:
        g = torch.Generator().manual_seed(0)
        for m, n, k in ((70, 24, 1000), (5, 384, 320), (33, 40, 64)):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k, generator=g).to(dtype)
                w = torch.randn(n, k, generator=g)
                got = kernel.rowwise_linear_fp32(x, w)
                within(got, ops_rw.rowwise_linear_fp32(x, w), _order_bound(x.float(), w))

    def rows_are_local() -> None:
        # A row's result must not depend on the other rows of the call. Here tl.dot is numpy's
        # matmul, and OpenBLAS's Haswell sgemm (numpy 2.4 on an AMD EPYC) sums a row in another
        # order at some positions of a tile (rows 6–11 and 18–31 of a 32-row tile), so the calls
        # below keep every row at its position in its tile: splits at whole tiles, and rows
        # alone in a tile. Moving rows between positions is checked on the GPU
        # (tests/gpu/test_rowwise_kernel.py: a CP 4 rank's rows x[1::4], an offset slice).
        g = torch.Generator().manual_seed(1)
        x, w = torch.randn(203, 300, generator=g).bfloat16(), torch.randn(24, 300, generator=g)
        full = kernel.rowwise_linear_fp32(x, w)
        bm = kernel.tiles(w.shape[0])[0]
        for m in (bm, 2 * bm, 3 * bm):
            parts = [kernel.rowwise_linear_fp32(x[a : a + m], w) for a in range(0, 203, m)]
            assert torch.equal(torch.cat(parts), full), m
        assert torch.equal(kernel.rowwise_linear_fp32(x[bm : bm + 5], w), full[bm : bm + 5])
        xs = torch.randn(9, 4, 80, generator=g)
        fn = torch.randn(24, 320, generator=g)
        mix = kernel.hc_mix_logits(xs, fn, norm_eps=1e-6)
        assert torch.equal(kernel.hc_mix_logits(xs[:3], fn, norm_eps=1e-6), mix[:3])

    def mix_logits_within_bound() -> None:
        g = torch.Generator().manual_seed(2)
        for t, h, d in ((40, 4, 256), (3, 1, 100), (17, 3, 70)):
            for dtype in (torch.float32, torch.bfloat16):
                scale = torch.exp2(torch.randint(-6, 6, (t, 1, 1), generator=g).float())
                x = (torch.randn(t, h, d, generator=g) * scale).to(dtype)
                fn = torch.randn((2 + h) * h, h * d, generator=g)
                got = kernel.hc_mix_logits(x, fn, norm_eps=1e-6)
                want = ops_hc.hc_mix_logits(x, fn, norm_eps=1e-6)
                xf = x.flatten(-2).float()
                rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6).double()
                bound = _order_bound(xf, fn) * rstd + 4 * 2.0**-23 * want.double().abs()
                within(got, want, bound)
        x = torch.randn(2, 3, 4, 32, generator=g).bfloat16()  # batched leading dims
        fn = torch.randn(24, 128, generator=g)
        got = kernel.hc_mix_logits(x, fn, norm_eps=1e-6)
        assert got.shape == (2, 3, 24)
        assert torch.equal(got[1], kernel.hc_mix_logits(x[1], fn, norm_eps=1e-6))

    def edges() -> None:
        w = torch.randn(24, 64)
        assert kernel.rowwise_linear_fp32(torch.zeros(0, 64), w).shape == (0, 24)
        zeros = kernel.hc_mix_logits(torch.zeros(3, 4, 16), w, norm_eps=1e-6)
        assert torch.equal(zeros, torch.zeros(3, 24))  # x = 0: rstd finite, logits 0
        wide = torch.randn(5, 200)[:, :64]  # strided rows
        within(
            kernel.rowwise_linear_fp32(wide, w),
            ops_rw.rowwise_linear_fp32(wide, w),
            _order_bound(wide, w),
        )

    return {k: v for k, v in locals().items() if k in CASES}


if __name__ == "__main__":
    report_cases(_cases(), sys.argv[1:])  # type: ignore[arg-type]
