"""kernels/fp8_dequant (an fp8 weight × its 32×32 block scales, one pass: the cuBLAS projection
path's weight operand) against `ops.linear.dequant_fp8_blocks`: bit for bit in fp32 and bf16
(every e4m3 code times a power-of-two scale is exact in both), every code, ragged N and K,
scales across the e8m0 range, a strided view, bad input named; under Triton's interpreter (a
child process), and compiled for sm_90 here. `dequant_mm` with it equals the GEMM of the twin's
operands bit for bit.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.kernels.interpreter_child import report_cases, run_interpreter_cases

CASES = ["every_code_bit_exact", "ragged_shapes_and_views", "dequant_mm_operands", "e8m0_edges"]


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    return run_interpreter_cases(__file__, CASES)


@pytest.mark.parametrize("case", CASES)
def test_fp8_dequant_in_the_interpreter(case: str, results: dict[str, str]) -> None:
    assert results[case] == "ok", results[case]


def test_bad_input_is_named() -> None:
    from dsv4cp.kernels.fp8_dequant import dequant_fp8_blocks

    w = torch.zeros(40, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scale shape \(1, 2\) != expected \(2, 2\)"):
        dequant_fp8_blocks(w, torch.ones(1, 2))
    with pytest.raises(ValueError, match="2-D float8_e4m3fn"):
        dequant_fp8_blocks(torch.zeros(40, 64), torch.ones(2, 2))
    with pytest.raises(ValueError, match="out_dtype"):
        dequant_fp8_blocks(w, torch.ones(2, 2), out_dtype=torch.int32)
    with pytest.raises(ValueError, match="must be powers of two"):
        dequant_fp8_blocks(w, torch.ones(2, 2), config=(3, 32, 1))


@pytest.mark.slow
def test_compiles_for_sm90() -> None:
    pytest.importorskip("triton")
    import triton.language as tl

    from dsv4cp.kernels.fp8_dequant import CONFIG, _dequant_fp8_kernel
    from tests.kernels.test_indexer_topk_compile import _compile

    block_r, block_k, warps = CONFIG
    for out, name in ((tl.bfloat16, "bf16"), (tl.float32, "fp32")):
        for e8m0, scale in ((True, "*u8"), (False, "*fp32")):
            types = ["*fp8e4nv", scale, f"*{name}", "i32", "i32", "i32", "i32", "i32"]
            const = dict(BLOCK=32, BLOCK_R=block_r, BLOCK_K=block_k, OUT_DTYPE=out,
                         EMULATE=False, E8M0=e8m0)  # fmt: skip
            _compile(_dequant_fp8_kernel, types, const, warps, 1)


# ------------------------------------------------------------------ the cases (child process only)


def _cases() -> dict[str, object]:
    from dsv4cp.kernels import fp8_dequant as kernel
    from dsv4cp.ops import linear as ops_linear

    def same(a: torch.Tensor, b: torch.Tensor) -> None:
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        bits = torch.int16 if a.element_size() == 2 else torch.int32
        assert torch.equal(a.view(bits), b.view(bits))

    def every_code_bit_exact() -> None:
        # each row holds all 254 finite codes (0x7f / 0xff, NaN, are no weight's) and two zeros,
        # under one scale per row block
        codes = torch.arange(256, dtype=torch.int32)
        codes = torch.cat([codes[(codes & 0x7F) != 0x7F], torch.zeros(2, dtype=torch.int32)])
        codes = codes.to(torch.uint8).repeat(96, 1)
        w = codes.view(torch.float8_e4m3fn)
        # byte 11 (2^-116): the smallest e4m3 subnormal times it is fp32's smallest normal
        scale = torch.tensor([11, 127, 200], dtype=torch.uint8)[:, None].expand(3, 8)
        scale = scale.contiguous().view(torch.float8_e8m0fnu)
        for out in (torch.float32, torch.bfloat16):
            got = kernel.dequant_fp8_blocks(w, scale, out_dtype=out)
            same(got, ops_linear.dequant_fp8_blocks(w, scale, out_dtype=out))

    def ragged_shapes_and_views() -> None:
        g = torch.Generator().manual_seed(0)
        for n, k in ((1, 32), (37, 96), (130, 1000), (33, 530)):
            w = (torch.randn(n, k, generator=g) * 40).to(torch.float8_e4m3fn)
            s = torch.randint(110, 135, ops_linear.fp8_scale_shape(n, k), generator=g)
            s = s.to(torch.uint8).view(torch.float8_e8m0fnu)
            for out in (torch.float32, torch.bfloat16):
                same(
                    kernel.dequant_fp8_blocks(w, s, out_dtype=out),
                    ops_linear.dequant_fp8_blocks(w, s, out_dtype=out),
                )
        wide = (torch.randn(40, 128, generator=g) * 40).to(torch.float8_e4m3fn)
        view = wide[:, :64]  # rows strided by 128 bytes
        s = torch.full((2, 2), 2.0**-6)
        same(kernel.dequant_fp8_blocks(view, s), ops_linear.dequant_fp8_blocks(view, s))

    def dequant_mm_operands() -> None:
        from dsv4cp.kernels.fp8_linear import dequant_weight_bf16

        g = torch.Generator().manual_seed(2)
        w = (torch.randn(96, 160, generator=g) * 40).to(torch.float8_e4m3fn)
        s = torch.randint(115, 125, (3, 5), generator=g).to(torch.uint8)
        s = s.view(torch.float8_e8m0fnu)
        want = ops_linear.dequant_fp8_blocks(w, s, out_dtype=torch.bfloat16)
        same(dequant_weight_bf16(w, s), want)

    def e8m0_edges() -> None:
        # the kernel decodes e8m0 bytes itself: 0 (fp32's subnormal 2^-127), 1, 127, 254 and
        # 255 (NaN) as ops.quant.e8m0_to_float does; torch's conversion (host_scales) and other
        # tile configs give the same bits
        g = torch.Generator().manual_seed(3)
        w = (torch.randn(160, 64, generator=g) * 40).to(torch.float8_e4m3fn)
        s = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8)[:, None].repeat(1, 2)
        s = s.view(torch.float8_e8m0fnu)
        want = ops_linear.dequant_fp8_blocks(w, s)
        nan = want.isnan()
        assert nan[128:].all() and not nan[:128].any()
        for kw in ({}, {"host_scales": True}, {"config": (32, 64, 4)}, {"config": (2, 32, 1)}):
            got = kernel.dequant_fp8_blocks(w, s, **kw)  # type: ignore[arg-type]
            assert torch.equal(got.isnan(), nan), kw
            same(got[:128], want[:128])
        raw = kernel.dequant_fp8_blocks(w, s.view(torch.uint8))  # raw bytes are e8m0 too
        same(raw[:128], want[:128])

    return {name: f for name, f in locals().items() if name in CASES}


if __name__ == "__main__":
    report_cases(_cases(), sys.argv[1:])  # type: ignore[arg-type]
