"""kernels/fp4_dequant (the routed experts' fp4 weights, one pass) against `ops.linear.dequant_fp4`:
bit for bit in fp32 and bf16 (every e2m1 code times a power-of-two scale is exact in both),
every code in both nibbles, every storage dtype, scales across the e8m0 range, a strided view,
bad input named; under Triton's interpreter (a child process), and compiled for sm_90 here.
The MoE's grouped path with the routed kernel equals it with the torch dequantization.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.kernels.interpreter_child import report_cases, run_interpreter_cases

CASES = [
    "every_code_bit_exact",
    "shapes_and_dtypes",
    "grouped_moe_with_the_kernel",
    "tiles_bit_exact",
]


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    return run_interpreter_cases(__file__, CASES)


@pytest.mark.parametrize("case", CASES)
def test_fp4_dequant_in_the_interpreter(case: str, results: dict[str, str]) -> None:
    assert results[case] == "ok", results[case]


def test_bad_input_is_named() -> None:
    from dsv4cp.kernels.fp4_dequant import dequant_fp4

    packed = torch.zeros(4, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"scale shape \(4, 1\) != expected \(4, 2\)"):
        dequant_fp4(packed, torch.ones(4, 1))
    with pytest.raises(ValueError, match="2-D int8/uint8"):
        dequant_fp4(torch.zeros(4, 32), torch.ones(4, 2))
    with pytest.raises(ValueError, match="out_dtype"):
        dequant_fp4(packed, torch.ones(4, 2), out_dtype=torch.int32)


@pytest.mark.slow
def test_compiles_for_sm90() -> None:
    pytest.importorskip("triton")
    import triton.language as tl

    from dsv4cp.kernels.fp4_dequant import CONFIG, _dequant_fp4_kernel
    from tests.kernels.test_indexer_topk_compile import _compile

    for out, name in ((tl.bfloat16, "bf16"), (tl.float32, "fp32")):
        for e8m0 in (True, False):
            types = ["*u8", "*u8" if e8m0 else "*fp32", f"*{name}", "i32", "i32", "i32", "i32"]
            types.append("i32")
            r, nbytes, warps = CONFIG
            const = dict(BLOCK=32, BLOCK_R=r, BLOCK_B=nbytes, OUT_DTYPE=out, EMULATE=False)
            _compile(_dequant_fp4_kernel, types, {**const, "E8M0": e8m0}, warps, 1)


# ------------------------------------------------------------------ the cases (child process only)


def _cases() -> dict[str, object]:
    from dsv4cp.kernels import fp4_dequant as kernel
    from dsv4cp.ops import linear as ops_linear

    def same(a: torch.Tensor, b: torch.Tensor) -> None:
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        assert torch.equal(
            a.view(torch.int16 if a.element_size() == 2 else torch.int32),
            b.view(torch.int16 if b.element_size() == 2 else torch.int32),
        )

    def every_code_bit_exact() -> None:
        # row r holds every byte (both nibbles: all 16 codes in each position) under one scale
        packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(6, 1)
        # byte 3 (2^-124): the smallest code, 0.5, stays a normal number; below it outputs are
        # subnormal, which the kernel may flush (no weight scale is that small)
        scale = torch.tensor([3, 100, 127, 128, 160, 200], dtype=torch.uint8)[:, None]
        scale = scale.expand(6, 512 // 32).contiguous().view(torch.float8_e8m0fnu)
        for out in (torch.float32, torch.bfloat16):
            same(
                kernel.dequant_fp4(packed, scale, out_dtype=out),
                ops_linear.dequant_fp4(packed, scale, out_dtype=out),
            )

    def shapes_and_dtypes() -> None:
        g = torch.Generator().manual_seed(0)
        for n, k in ((1, 32), (37, 96), (130, 2304)):
            raw = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int32)
            scale = torch.randint(110, 135, (n, k // 32), generator=g, dtype=torch.int32)
            scale = scale.to(torch.uint8).view(torch.float8_e8m0fnu)
            for dtype in (torch.uint8, torch.int8, torch.float4_e2m1fn_x2):
                packed = raw.to(torch.uint8).view(dtype)
                for out in (torch.float32, torch.bfloat16):
                    same(
                        kernel.dequant_fp4(packed, scale, out_dtype=out),
                        ops_linear.dequant_fp4(packed, scale, out_dtype=out),
                    )
        wide = torch.randint(0, 256, (8, 64), generator=g, dtype=torch.int32).to(torch.uint8)
        view = wide[:, :32]  # rows strided by 64 bytes
        scale = torch.full((8, 2), 2.0**-6)
        same(kernel.dequant_fp4(view, scale), ops_linear.dequant_fp4(view, scale))

    def grouped_moe_with_the_kernel() -> None:
        from dsv4cp.kernels import fp8_linear as fp8_kernel
        from dsv4cp.ops.moe_experts import ExpertKernels, grouped_expert_mlp
        from dsv4cp.ops.moe_weights import ExpertStack

        g = torch.Generator().manual_seed(1)
        e, d, inter = 6, 64, 96

        def stack(n_out: int, n_in: int) -> ExpertStack:
            w = torch.randint(0, 256, (e, n_out, n_in // 2), generator=g, dtype=torch.int32)
            s = torch.randint(118, 124, (e, n_out, n_in // 32), generator=g, dtype=torch.int32)
            return ExpertStack(w.to(torch.uint8), s.to(torch.uint8).view(torch.float8_e8m0fnu))

        w1, w3, w2 = stack(inter, d), stack(inter, d), stack(d, inter)
        routed = ExpertKernels(kernel.dequant_fp4, fp8_kernel.fake_act_quant_fp8)
        counts = torch.tensor([3, 0, 5, 1, 0, 7])
        x = torch.randn(int(counts.sum()), d, generator=g).bfloat16()
        rw = torch.rand(x.shape[0], generator=g)
        kw = dict(route_weight=rw, swiglu_limit=7.0, quant="qat", backend="grouped_mm")
        for chunk in (2, 32):
            want = grouped_expert_mlp(x, counts, w1, w3, w2, expert_chunk=chunk, **kw)
            got = grouped_expert_mlp(
                x, counts, w1, w3, w2, expert_chunk=chunk, kernels=routed, **kw
            )
            same(got, want)

    def tiles_bit_exact() -> None:
        """Other tile configs: every code, ragged row counts, several tiles, both dtypes."""
        g = torch.Generator().manual_seed(2)
        every = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(5, 1)
        cases = [(every, 512)]
        for n, k in ((1, 32), (37, 96), (9, 1024), (130, 2304)):
            raw = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int32)
            cases.append((raw.to(torch.uint8), k))
        for packed, k in cases:
            n = packed.shape[0]
            scale = torch.randint(100, 140, (n, k // 32), generator=g, dtype=torch.int32)
            scale = scale.to(torch.uint8).view(torch.float8_e8m0fnu)
            for out in (torch.float32, torch.bfloat16):
                want = ops_linear.dequant_fp4(packed, scale, out_dtype=out)
                small = packed.numel() <= 4096  # the interpreter steps every program
                for config in [kernel.CONFIG] + ([(1, 16, 1), (2, 64, 2)] if small else []):
                    got = kernel.launch_dequant_fp4(packed, scale, out_dtype=out, config=config)
                    same(got, want)
        try:
            kernel.launch_dequant_fp4(every, scale[:5, :16], config=(1, 24, 1))
            raise AssertionError("a tile of partial scale blocks must be refused")
        except ValueError as e:
            assert "not whole blocks" in str(e)

    return {name: f for name, f in locals().items() if name in CASES}


if __name__ == "__main__":
    report_cases(_cases(), sys.argv[1:])  # type: ignore[arg-type]
