"""kernels/sinkhorn (mHC's Sinkhorn split, one launch) against `ops.hyper_connections`'s
`sinkhorn_split`, under Triton's interpreter (a child process); compiled for sm_90 here. The GPU
comparison runs in tests/gpu (`-m gpu`).

The kernel does the twin's operations in the twin's order (sigmoid as 1 / (1 + exp(-x)), the
max-subtracted exp, sequential row and column sums, the +eps placements, FMA contraction off),
so the only source of difference is exp itself: `tl.exp` (numpy's in the interpreter, libdevice's
expf on the GPU) against torch's. Both are within 1 ulp of exact, so they differ by at most
4u (u = 2⁻²⁴, relative; a sweep of 2·10⁷ arguments measured 3.2u). The bound, per value and
relative to the twin's |value| (floored at 2⁻¹²⁶, below which fp32 rounds absolutely):

- post = 2σ: 8u — the exp's 4u carried through 1 + e (scaled by e/(1+e) ≤ 1), plus the two
  roundings (1 + e and the reciprocal) on each side diverging by 2u each; pre = σ + eps: 10u (one
  more rounding). Measured: ≤ 4.7u.
- comb: 12u + 4u·(iters − 1). The softmax stage's entry carries the numerator's exp divergence
  (4u), the row sum's, which is that of its terms (4u), and the division and +eps (2u each). Each
  later normalisation divides by a sum of the same entries on both sides, whose divergence is
  theirs: the Sinkhorn map does not amplify a relative perturbation (it contracts Hilbert's
  projective metric), so what a normalisation adds is its division's rounding, 2u, and a round
  (row + column) 4u. Measured: ≤ 8.0u at iters = 1 and ≤ 37.2u at iters = 20 (H = 3, logits
  ±80, eps = 1e-30; the growth is on entries far below the largest of their row and column), over
  random (N(0, 9)), saturating (±80 and uniform in ±80: exp underflows) and all-equal logits,
  eps 1e-30, 1e-6 and 0.5, H = 1..4.

All-equal comb logits (exp(0) = 1 exactly), zero pre/post arguments (σ(0) = 1/2) and H = 1's
comb involve no differing exp, and must be bit-identical; row locality (CP = N equals CP = 1)
is checked bit for bit.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.kernels.interpreter_child import report_cases, run_interpreter_cases

CASES = ["within_bound_of_twin", "exact_where_no_exp_differs", "shapes_and_row_locality"]

U = 2.0**-24
TINY = 2.0**-126


def bounds(iters: int) -> tuple[float, float, float]:
    """Relative bounds (in units of the twin's |value|) for pre, post, comb: see the docstring."""
    return 10 * U, 8 * U, (12 + 4 * (iters - 1)) * U


def relative_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| / max(|want|, 2⁻¹²⁶); NaN where either is NaN must agree."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.float32
    nan = torch.isnan(want)
    assert torch.equal(nan, torch.isnan(got)), "NaN positions differ"
    d = (got - want).abs()[~nan] / want.abs()[~nan].clamp_min(TINY)
    return float(d.max()) if d.numel() else 0.0


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    return run_interpreter_cases(__file__, CASES)


@pytest.mark.parametrize("case", CASES)
def test_sinkhorn_kernel_in_the_interpreter(case: str, results: dict[str, str]) -> None:
    assert results[case] == "ok", results[case]


def test_bad_input_is_named() -> None:
    from dsv4cp.kernels.sinkhorn import sinkhorn_split

    h, mix = 4, 24
    scale, base = torch.ones(3), torch.zeros(mix)
    kw = {"hc_mult": h, "iters": 20, "eps": 1e-6}
    with pytest.raises(ValueError, match="logits must be one of .*float64"):
        sinkhorn_split(torch.zeros(2, mix, dtype=torch.float64), scale, base, **kw)
    with pytest.raises(ValueError, match="base must be one of .*int64"):
        sinkhorn_split(torch.zeros(2, mix), scale, torch.zeros(mix, dtype=torch.long), **kw)
    with pytest.raises(ValueError, match="logits last dim must be 24"):
        sinkhorn_split(torch.zeros(2, mix + 1), scale, base, **kw)
    with pytest.raises(ValueError, match=r"base must be \[24\]"):
        sinkhorn_split(torch.zeros(2, mix), scale, base[:-1], **kw)
    with pytest.raises(ValueError, match=r"scale must be \[3\]"):
        sinkhorn_split(torch.zeros(2, mix), scale[:2], base, **kw)
    with pytest.raises(ValueError, match="hc_sinkhorn_iters"):
        sinkhorn_split(torch.zeros(2, mix), scale, base, hc_mult=h, iters=0, eps=1e-6)


def test_compiles_for_sm90() -> None:
    pytest.importorskip("triton")
    from dsv4cp.kernels.sinkhorn import BLOCK_T, _sinkhorn_kernel
    from tests.kernels.test_indexer_topk_compile import _compile

    types = ["*fp32"] * 6 + ["i32", "i32", "fp32", "i32"]
    for h, h_pad in ((4, 4), (3, 4), (1, 2)):
        const = dict(H=h, H_PAD=h_pad, BLOCK=BLOCK_T, PRECISE=True)
        ptx = _compile(_sinkhorn_kernel, types, const, 4, 1)
        assert "div.rn" in ptx  # IEEE divisions (libdevice), as torch's


# ------------------------------------------------------------------ the cases (child process only)


def _cases() -> dict[str, object]:
    from dsv4cp.kernels import sinkhorn as kernel
    from dsv4cp.ops import hyper_connections as ops_hc

    def params(h: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
        g = torch.Generator().manual_seed(seed)
        return torch.rand(3, generator=g) + 0.5, torch.randn((2 + h) * h, generator=g), g

    def logit_sets(h: int, g: torch.Generator) -> dict[str, torch.Tensor]:
        mix = (2 + h) * h
        sign = torch.where(torch.rand(256, mix, generator=g) < 0.5, -1.0, 1.0)
        return {
            "random": torch.randn(512, mix, generator=g) * 3,
            "uniform ±80": sign * torch.rand(256, mix, generator=g) * 80,
            "±80": torch.where(torch.rand(256, mix, generator=g) < 0.5, -80.0, 80.0),
        }

    def both(logits, scale, base, h, iters, eps):  # type: ignore[no-untyped-def]
        kw = {"hc_mult": h, "iters": iters, "eps": eps}
        return kernel.sinkhorn_split(logits, scale, base, **kw), ops_hc.sinkhorn_split(
            logits, scale, base, **kw
        )

    def within_bound_of_twin() -> None:
        worst: dict[tuple[int, int], list[float]] = {}
        for h in (1, 2, 3, 4):
            scale, base, g = params(h, 10 + h)
            for name, logits in logit_sets(h, g).items():
                for iters in (1, 2, 20):
                    for eps in (1e-30, 1e-6, 0.5):
                        got, want = both(logits, scale, base, h, iters, eps)
                        diffs = [relative_diff(a, b) for a, b in zip(got, want)]
                        where = f"H={h} {name} iters={iters} eps={eps}"
                        for what, d, bound in zip(("pre", "post", "comb"), diffs, bounds(iters)):
                            assert d <= bound, f"{where}: {what} {d / U:.2f}u > {bound / U}u"
                        w = worst.setdefault((h, iters), [0.0, 0.0, 0.0])
                        worst[(h, iters)] = [max(a, b / U) for a, b in zip(w, diffs)]
        print(f"worst pre/post/comb in u: {worst}", file=sys.stderr)

    def exact_where_no_exp_differs() -> None:
        for h in (1, 2, 3, 4):
            mix = (2 + h) * h
            for iters in (1, 20):
                for eps in (0.0, 1e-6, 0.5):
                    # all-equal comb logits: exp(0) = 1; zero pre/post logits: σ(0) = 1 / 2
                    logits = torch.cat([torch.zeros(9, 2 * h), torch.full((9, h * h), 1.7)], -1)
                    got, want = both(logits, torch.ones(3), torch.zeros(mix), h, iters, eps)
                    for a, b in zip(got, want):
                        assert torch.equal(a, b), (h, iters, eps)
        scale, base, g = params(1, 3)
        logits = torch.randn(100, 3, generator=g) * 5
        got, want = both(logits, scale, base, 1, 20, 1e-6)
        assert torch.equal(got.comb, want.comb)

    def shapes_and_row_locality() -> None:
        h, mix = 4, 24
        scale, base, g = params(h, 5)
        logits = torch.randn(2, 3, mix, generator=g) * 3
        got, want = both(logits, scale, base, h, 20, 1e-6)
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.is_contiguous() and a.dtype == torch.float32
        for shape in ((0, mix), (2, 0, mix)):
            got, want = both(torch.zeros(shape), scale, base, h, 20, 1e-6)
            assert [a.shape for a in got] == [b.shape for b in want]
        # strided logits (a slice of wider rows) and bf16 logits / params: the twin's .float()
        wide = torch.randn(70, 40, generator=g) * 3
        got = kernel.sinkhorn_split(
            wide[:, 5 : 5 + mix], scale, base, hc_mult=h, iters=20, eps=1e-6
        )
        dense = kernel.sinkhorn_split(
            wide[:, 5 : 5 + mix].contiguous(), scale, base, hc_mult=h, iters=20, eps=1e-6
        )
        for a, b in zip(got, dense):
            assert torch.equal(a, b)
        lb, sb, bb = wide[:, :mix].bfloat16(), scale.bfloat16(), base.bfloat16()
        got, want = both(lb, sb, bb, h, 20, 1e-6)
        for a, b, bound in zip(got, want, bounds(20)):
            assert relative_diff(a, b) <= bound
        # row locality: any split of the tokens, at any block offset, gives the same bits
        logits = torch.randn(200, mix, generator=g) * 3
        whole = kernel.sinkhorn_split(logits, scale, base, hc_mult=h, iters=20, eps=1e-6)
        for a, b in ((0, 1), (1, 64), (63, 130), (130, 200)):
            part = kernel.sinkhorn_split(logits[a:b], scale, base, hc_mult=h, iters=20, eps=1e-6)
            for x, y in zip(whole, part):
                assert torch.equal(x[a:b], y), (a, b)

    return {k: v for k, v in locals().items() if k in CASES}


if __name__ == "__main__":
    report_cases(_cases(), sys.argv[1:])  # type: ignore[arg-type]
