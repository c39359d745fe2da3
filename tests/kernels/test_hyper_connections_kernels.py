"""kernels/hyper_connections (mHC's collapse and expand, one pass each) against
`ops.hyper_connections`: equal value for value in fp32 and bf16 (the twin's order: products
rounded in fp32, a sequential sum over the source stream, one rounding), H = 1, 3, 4, widths
that are not a multiple of the block, strided and batched shapes, bad input named; under
Triton's interpreter (a child process), and compiled for sm_90 here. The GPU comparison runs in
tests/gpu (`-m gpu`)."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.kernels.interpreter_child import report_cases, run_interpreter_cases

CASES = ["collapse_equals_twin", "expand_equals_twin", "adversarial_values"]


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    return run_interpreter_cases(__file__, CASES)


@pytest.mark.parametrize("case", CASES)
def test_hc_kernels_in_the_interpreter(case: str, results: dict[str, str]) -> None:
    assert results[case] == "ok", results[case]


def test_bad_input_is_named() -> None:
    from dsv4cp.kernels.hyper_connections import hc_collapse, hc_expand

    x = torch.zeros(3, 4, 8)
    with pytest.raises(ValueError, match=r"pre must be \(3, 4\)"):
        hc_collapse(x, torch.zeros(3, 3))
    with pytest.raises(ValueError, match="does not match y"):
        hc_expand(torch.zeros(3, 7), x, torch.zeros(3, 4), torch.zeros(3, 4, 4))
    with pytest.raises(ValueError, match="post must be"):
        hc_expand(torch.zeros(3, 8), x, torch.zeros(3, 4), torch.zeros(3, 4, 3))
    with pytest.raises(ValueError, match="take"):
        hc_collapse(x.double(), torch.zeros(3, 4))


def test_compiles_for_sm90() -> None:
    pytest.importorskip("triton")
    import triton.language as tl

    from dsv4cp.kernels.hyper_connections import _hc_collapse_kernel, _hc_expand_kernel
    from tests.kernels.test_indexer_topk_compile import _compile

    for out, name in ((tl.bfloat16, "bf16"), (tl.float32, "fp32")):
        const = dict(H=4, BLOCK=512, OUT=out, EMULATE=False)
        types = [f"*{name}", "*fp32", f"*{name}"] + ["i32"] * 5
        _compile(_hc_collapse_kernel, types, const, 4, 1)
        types = [f"*{name}", f"*{name}", "*fp32", "*fp32", f"*{name}"] + ["i32"] * 10
        _compile(_hc_expand_kernel, types, dict(const, H_PAD=4), 4, 1)


# ------------------------------------------------------------------ the cases (child process only)


def _cases() -> dict[str, object]:
    from dsv4cp.kernels import hyper_connections as kernel
    from dsv4cp.ops import hyper_connections as ops_hc

    def same(a: torch.Tensor, b: torch.Tensor) -> None:
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        assert torch.equal(a, b), float((a.float() - b.float()).abs().max())

    def inputs(t: int, h: int, d: int, dtype: torch.dtype, seed: int) -> tuple:
        g = torch.Generator().manual_seed(seed)
        scale = torch.exp2(torch.randint(-8, 8, (t, h, 1), generator=g).float())
        x = (torch.randn(t, h, d, generator=g) * scale).to(dtype)
        y = torch.randn(t, d, generator=g).to(dtype)
        pre = torch.rand(t, h, generator=g) + 1e-6
        post = 2 * torch.rand(t, h, generator=g)
        comb = torch.rand(t, h, h, generator=g)
        return x, y, pre, post, comb

    def collapse_equals_twin() -> None:
        for h, d in ((4, 700), (1, 64), (3, 1030)):
            for dtype in (torch.float32, torch.bfloat16):
                x, _, pre, _, _ = inputs(5, h, d, dtype, h + d)
                same(kernel.hc_collapse(x, pre), ops_hc.hc_collapse(x, pre))
        x, _, pre, _, _ = inputs(6, 4, 96, torch.bfloat16, 1)
        xb, pb = x.view(2, 3, 4, 96), pre.view(2, 3, 4)  # batched leading dims
        same(kernel.hc_collapse(xb, pb), ops_hc.hc_collapse(xb, pb))
        wide = torch.randn(6, 4, 200).bfloat16()[..., :96]  # strided rows
        same(kernel.hc_collapse(wide, pre), ops_hc.hc_collapse(wide, pre))

    def expand_equals_twin() -> None:
        for h, d in ((4, 700), (1, 64), (3, 1030)):
            for dtype in (torch.float32, torch.bfloat16):
                x, y, _, post, comb = inputs(5, h, d, dtype, 7 * h + d)
                same(kernel.hc_expand(y, x, post, comb), ops_hc.hc_expand(y, x, post, comb))
        x, y, _, post, comb = inputs(6, 4, 96, torch.bfloat16, 2)
        args = (y.view(2, 3, 96), x.view(2, 3, 4, 96), post.view(2, 3, 4), comb.view(2, 3, 4, 4))
        same(kernel.hc_expand(*args), ops_hc.hc_expand(*args))
        wide = torch.randn(6, 4, 200).bfloat16()[..., 50:146]
        same(kernel.hc_expand(y, wide, post, comb), ops_hc.hc_expand(y, wide, post, comb))

    def adversarial_values() -> None:
        """Cancellation across streams, zeros, large and tiny magnitudes: the order matters."""
        x = torch.tensor([[1e8, -1e8, 3.0, 1e-30], [0.0, -0.0, 5e-39, 65504.0]])
        x = x.view(1, 4, 2).repeat(3, 1, 64)
        pre = torch.tensor([[1.0, 1.0, 1e-8, 7.0]]).repeat(3, 1)
        same(kernel.hc_collapse(x, pre), ops_hc.hc_collapse(x, pre))
        same(kernel.hc_collapse(x.bfloat16(), pre), ops_hc.hc_collapse(x.bfloat16(), pre))
        y = torch.full((3, 128), 3.0)
        comb = torch.tensor([[1.0, 0.5, 1e-7, 2.0]]).repeat(3, 4, 1).transpose(1, 2)
        post = torch.tensor([[0.0, 1.0, 2.0, 1e-3]]).repeat(3, 1)
        same(kernel.hc_expand(y, x, post, comb), ops_hc.hc_expand(y, x, post, comb))
        yb, xb = y.bfloat16(), x.bfloat16()
        same(kernel.hc_expand(yb, xb, post, comb), ops_hc.hc_expand(yb, xb, post, comb))

    return {k: v for k, v in locals().items() if k in CASES}


if __name__ == "__main__":
    report_cases(_cases(), sys.argv[1:])  # type: ignore[arg-type]
