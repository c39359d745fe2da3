"""kernels/moe_fp4_gemm on CUDA at Flash dims (384 experts, d 5120, inter 2304, 16K tokens
top-6 routed by a skewed random gate: empty and crowded experts) against its twin within the
order bound of tests/kernels/test_moe_fp4_gemm.py, and the MoE with the fused projection against
the chunked torch._grouped_mm path."""

from __future__ import annotations

import pytest
import torch

from dsv4cp.kernels.moe_fp4_gemm import grouped_fp4_mm
from dsv4cp.ops import moe_experts as ops_moe
from dsv4cp.ops.linear import dequant_fp4
from dsv4cp.ops.moe_weights import ExpertStack
from dsv4cp.tools.reference_check import ulp_bf16

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _stack(e: int, n: int, k: int, g: torch.Generator) -> ExpertStack:
    w = torch.randint(0, 256, (e, n, k // 2), device="cuda", generator=g, dtype=torch.int32)
    s = torch.randint(118, 124, (e, n, k // 32), device="cuda", generator=g, dtype=torch.int32)
    return ExpertStack(w.to(torch.uint8), s.to(torch.uint8).view(torch.float8_e8m0fnu))


def _counts(pairs: int, experts: int, g: torch.Generator) -> torch.Tensor:
    weight = torch.rand(experts, device="cuda", generator=g) ** 4  # skewed; some near empty
    pick = torch.multinomial(weight, pairs, replacement=True, generator=g)
    return torch.bincount(pick, minlength=experts)


def test_fused_projection_matches_the_twin_at_flash_dims() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    e, d, inter = 384, 5120, 2304
    counts = _counts(16384 * 6, e, g)
    x = torch.randn(int(counts.sum()), d, device="cuda", generator=g).bfloat16()
    st = _stack(e, inter, d, g)
    got = grouped_fp4_mm(x, counts, st)
    want = ops_moe.grouped_fp4_mm(x, counts, st)
    start, worst = 0, 0.0
    for i, n in enumerate(counts.tolist()):  # the bound, expert by expert
        if n:
            w = dequant_fp4(st.weight[i], st.scale[i]).abs()
            terms = x[start : start + n].float().abs() @ w.t()
            limit = 2 * d * 2.0**-24 * terms + ulp_bf16(want[start : start + n])
            err = (got[start : start + n].float() - want[start : start + n].float()).abs()
            worst = max(worst, float((err / limit).max()))
        start += n
    print(f"fused fp4 projection: max err / bound {worst:.3g}")
    assert worst <= 1.0


def test_moe_with_the_fused_projection_equals_the_chunked_path() -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    e, d, inter = 64, 1024, 512
    w1, w3, w2 = _stack(e, inter, d, g), _stack(e, inter, d, g), _stack(e, d, inter, g)
    counts = _counts(8192, e, g)
    x = torch.randn(int(counts.sum()), d, device="cuda", generator=g).bfloat16()
    rw = torch.rand(x.shape[0], device="cuda", generator=g)
    args = dict(route_weight=rw, swiglu_limit=7.0, quant="qat")
    fused = ops_moe.grouped_expert_mlp(
        x, counts, w1, w3, w2, backend="fused",
        kernels=ops_moe.ExpertKernels(grouped_fp4_mm=grouped_fp4_mm), **args,
    )  # fmt: skip
    chunked = ops_moe.grouped_expert_mlp(
        x, counts, w1, w3, w2, backend="grouped_mm", expert_chunk=16, **args
    )
    rel = float((fused.float() - chunked.float()).norm() / chunked.float().norm())
    print(f"MoE fused vs chunked: rel rms {rel:.3g}")
    assert rel <= 2.0**-8  # one bf16 rounding where the fp32 sums' orders differ
