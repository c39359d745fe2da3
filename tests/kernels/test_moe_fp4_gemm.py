"""kernels/moe_fp4_gemm (every expert's projection in one launch, fp4 decoded in the K loop)
against `ops.moe_experts.grouped_fp4_mm` under Triton's interpreter (a child process), and
compiled for sm_90 here; the GPU comparison at Flash dims is tests/gpu/test_moe_fp4_gemm_gpu.py.

Both compute exact products (bf16 activations × fp4 values times powers of two, exact in fp32)
summed in fp32 and rounded once, in different orders, so the bound per output is the order bound
2·K·2⁻²⁴·Σ_k|x_k·w_k| plus one ulp of the output dtype (the two fp32 sums may round to
neighbouring bf16 values)."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.kernels.interpreter_child import report_cases, run_interpreter_cases

CASES = ["equals_twin_within_bound", "expert_layouts", "moe_with_the_fused_kernel"]


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    return run_interpreter_cases(__file__, CASES)


@pytest.mark.parametrize("case", CASES)
def test_fused_grouped_fp4_in_the_interpreter(case: str, results: dict[str, str]) -> None:
    assert results[case] == "ok", results[case]


def test_bad_input_is_named() -> None:
    from dsv4cp.kernels.moe_fp4_gemm import grouped_fp4_mm
    from dsv4cp.ops.moe_weights import ExpertStack

    w = torch.zeros(3, 8, 32, dtype=torch.uint8)
    s = torch.full((3, 8, 2), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    x = torch.zeros(5, 64, dtype=torch.bfloat16)
    counts = torch.tensor([2, 0, 3])
    with pytest.raises(ValueError, match="counts must be integer"):
        grouped_fp4_mm(x, counts.float(), ExpertStack(w, s))
    with pytest.raises(ValueError, match=r"xq must be \[P, 64\]"):
        grouped_fp4_mm(x[:, :32], counts, ExpertStack(w, s))
    with pytest.raises(ValueError, match="scales must be e8m0"):
        grouped_fp4_mm(x, counts, ExpertStack(w, torch.ones(3, 8, 2)))
    with pytest.raises(ValueError, match="bf16 or fp16"):
        grouped_fp4_mm(x.float(), counts, ExpertStack(w, s))


def test_compiles_for_sm90() -> None:
    pytest.importorskip("triton")
    import triton.language as tl

    from dsv4cp.kernels import moe_fp4_gemm as k
    from tests.kernels.test_indexer_topk_compile import _compile

    types = ["*bf16", "*u8", "*u8", "*bf16", "*i32", "*i32"] + ["i32"] * 9
    const = dict(
        TILE_M=k.BM, TILE_N=k.BN, TILE_K=k.BK, STEPS=k.SEARCH_STEPS, OUT=tl.bfloat16, UPCAST=False
    )
    ptx = _compile(k._grouped_fp4_kernel, types, const, k.WARPS, k.STAGES)
    assert "mma" in ptx  # the products on the tensor cores


# ------------------------------------------------------------------ the cases (child process only)


def _cases() -> dict[str, object]:
    from dsv4cp.kernels import moe_fp4_gemm as kernel
    from dsv4cp.ops import moe_experts as ops_moe
    from dsv4cp.ops.linear import dequant_fp4
    from dsv4cp.ops.moe_weights import ExpertStack
    from dsv4cp.tools.reference_check import ulp_bf16

    def stack(e: int, n: int, k: int, g: torch.Generator) -> ExpertStack:
        w = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.int32)
        s = torch.randint(118, 130, (e, n, k // 32), generator=g, dtype=torch.int32)
        return ExpertStack(w.to(torch.uint8), s.to(torch.uint8).view(torch.float8_e8m0fnu))

    def bound(x: torch.Tensor, counts: torch.Tensor, st: ExpertStack) -> torch.Tensor:
        out = torch.zeros(x.shape[0], st.weight.shape[1], dtype=torch.float64)
        start = 0
        for e, n in enumerate(counts.tolist()):
            w = dequant_fp4(st.weight[e], st.scale[e]).double().abs()
            out[start : start + n] = x[start : start + n].double().abs() @ w.t()
            start += n
        return 2 * x.shape[1] * 2.0**-24 * out

    def within(x: torch.Tensor, counts: torch.Tensor, st: ExpertStack) -> None:
        got = kernel.grouped_fp4_mm(x, counts, st)
        want = ops_moe.grouped_fp4_mm(x, counts, st)
        assert got.shape == want.shape and got.dtype == want.dtype
        err = (got.double() - want.double()).abs()
        limit = bound(x, counts, st) + ulp_bf16(want).double()
        assert bool((err <= limit).all()), float((err - limit).max())

    def equals_twin_within_bound() -> None:
        g = torch.Generator().manual_seed(0)
        st = stack(5, 40, 96, g)  # N not a multiple of BN, K not of BK
        counts = torch.tensor([70, 0, 3, 130, 1])  # several row tiles, an empty expert
        x = torch.randn(int(counts.sum()), 96, generator=g).bfloat16()
        within(x, counts, st)
        wide = torch.randn(int(counts.sum()), 160, generator=g).bfloat16()[:, 32:128]
        within(wide, counts, st)  # strided rows

    def expert_layouts() -> None:
        g = torch.Generator().manual_seed(1)
        st = stack(4, 16, 64, g)
        for counts in ([0, 0, 0, 200], [200, 0, 0, 0], [0, 1, 0, 0], [64, 64, 64, 64]):
            c = torch.tensor(counts)
            within(torch.randn(int(c.sum()), 64, generator=g).bfloat16(), c, st)
        empty = kernel.grouped_fp4_mm(torch.zeros(0, 64).bfloat16(), torch.zeros(4).long(), st)
        assert empty.shape == (0, 16)

    def moe_with_the_fused_kernel() -> None:
        """The grouped MoE with the fused projection against the experts' loop (the twin)."""
        g = torch.Generator().manual_seed(2)
        e, d, inter = 6, 64, 96
        w1, w3, w2 = stack(e, inter, d, g), stack(e, inter, d, g), stack(e, d, inter, g)
        counts = torch.tensor([9, 0, 40, 3, 70, 1])
        x = torch.randn(int(counts.sum()), d, generator=g).bfloat16()
        rw = torch.rand(x.shape[0], generator=g)
        kernels = ops_moe.ExpertKernels(grouped_fp4_mm=kernel.grouped_fp4_mm)
        args = dict(route_weight=rw, swiglu_limit=7.0, quant="none")
        fused = ops_moe.grouped_expert_mlp(
            x, counts, w1, w3, w2, backend="fused", kernels=kernels, **args
        )
        loop = ops_moe.grouped_expert_mlp(x, counts, w1, w3, w2, backend="loop", **args)
        rel = float((fused.float() - loop.float()).norm() / loop.float().norm())
        # the bf16 intermediates round at the same places, their fp32 sums in other orders:
        # at most one bf16 rounding apart where they differ (measured 0.0 here)
        assert rel <= 2.0**-8, rel

    return {k: v for k, v in locals().items() if k in CASES}


if __name__ == "__main__":
    report_cases(_cases(), sys.argv[1:])  # type: ignore[arg-type]
