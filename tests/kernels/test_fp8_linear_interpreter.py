"""kernels/fp8_linear on the CPU through Triton's interpreter, against the ops twins.

The interpreter must be switched on before triton is imported, so the launches run in one child
process (this file as a script) and report back as JSON. The quantizer is compared bit for bit
(the golden inputs, every finite bf16 value included); the GEMM bit for bit where block sums are
exact, else within the fp32 dot-product bound (the interpreter's fp32 block products round where
the twin's exact ones do not).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "fixtures" / "quant_golden.safetensors"
CASES = (
    "act_quant_golden",
    "act_quant_shapes",
    "fake_act_quant",
    "gemm_golden",
    "gemm_odd_shapes",
    "gemm_cublas_path",
    "rows_valid_zeroes_rows",
)


@pytest.fixture(scope="module")
def child_results() -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "python")}
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900
    )
    report = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and report, (
        f"child failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    )
    return json.loads(report[-1])


@pytest.mark.parametrize("case", CASES)
def test_fp8_kernels_in_the_interpreter(case: str, child_results: dict[str, str]) -> None:
    assert child_results[case] == "ok", child_results[case]


def test_launchers_reject_bad_shapes() -> None:
    from dsv4cp.kernels.fp8_linear import act_quant_fp8, fp8_linear

    w = torch.zeros(64, 96).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiple of block=32"):
        act_quant_fp8(torch.zeros(2, 48))
    with pytest.raises(ValueError, match=r"scale shape \(3, 2\) != expected \(2, 3\)"):
        fp8_linear(torch.zeros(2, 96), w, torch.ones(3, 2))
    with pytest.raises(ValueError, match="in_features 96"):
        fp8_linear(torch.zeros(2, 64), w, torch.ones(2, 3))


def test_gluon_mode_replaces_only_the_cublas_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """DSV4CP_FP8_GEMM=gluon: the Gluon kernel where auto takes cuBLAS on the per-call
    dequantized weight; a kept bf16 weight stays on cuBLAS, small or fp32-out GEMMs and the
    interpreter on the Triton kernel; on a CPU tensor the kernel refuses by name."""
    from dsv4cp.kernels import fp8_linear as kernel

    monkeypatch.setattr(kernel, "interpreting", lambda: False)
    monkeypatch.setenv(kernel.FP8_GEMM_FLAG, "gluon")
    big, small = torch.zeros(512, 96).bfloat16(), torch.zeros(511, 96).bfloat16()
    assert kernel._gemm_backend(big, torch.bfloat16) == "gluon"
    assert kernel._gemm_backend(big, torch.bfloat16, kept=True) == "cublas"
    assert kernel._gemm_backend(big, torch.float32) == "triton"
    assert kernel._gemm_backend(small, torch.bfloat16) == "triton"
    monkeypatch.setenv(kernel.FP8_GEMM_FLAG, "auto")
    assert kernel._gemm_backend(big, torch.bfloat16) == "cublas"
    monkeypatch.setenv(kernel.FP8_GEMM_FLAG, "gluon")
    w = torch.zeros(64, 96).to(torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="fp8_gemm_gluon: needs a Hopper GPU"):
        kernel.fp8_linear(big, w, torch.ones(2, 3))
    monkeypatch.setattr(kernel, "interpreting", lambda: True)
    assert kernel._gemm_backend(big, torch.bfloat16) == "triton"


def test_act_quant_compiles_for_sm90() -> None:
    pytest.importorskip("triton")
    from dsv4cp.kernels.fp8_linear import _act_quant_kernel
    from tests.kernels.test_indexer_topk_compile import _compile

    for out, dequant, mask in (
        ("*fp8e4nv", False, False),
        ("*bf16", True, False),
        ("*fp32", True, False),
        ("*bf16", True, True),
    ):
        types = ["*bf16", out, "*fp32", "i32", "i32", "i32", "i32", "i32", "*u8"]
        const = dict(BLOCK=32, N_BLOCKS=4, ROWS=4, DEQUANT=dequant, ROW_MASK=mask)
        _compile(_act_quant_kernel, types, const, 4, 1)


# ------------------------------------------------------------------ the cases (child process only)


def _within_gemm_bound(
    got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor
) -> None:
    from dsv4cp.ops.linear import dequant_fp8_blocks, fp8_linear
    from dsv4cp.ops.quant import fake_act_quant_fp8

    a = fake_act_quant_fp8(x.float())
    b = dequant_fp8_blocks(w, scale)
    bound = 2 * (32 + x.shape[-1] // 32) * 2.0**-24 * (a.abs() @ b.abs().t())
    want = fp8_linear(x, w, scale, out_dtype=torch.float32)
    assert bool(((got - want).abs() <= bound).all()), float((got - want).abs().max())


def _child_cases() -> dict[str, object]:
    from safetensors.torch import load_file

    from dsv4cp.kernels import fp8_linear as kernel
    from dsv4cp.ops import linear as ops_linear
    from dsv4cp.ops import quant as ops_quant

    golden = load_file(GOLDEN)

    def same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    def act_quant_golden() -> None:
        for case in ("adversarial", "random", "allbf16"):
            codes, scale = kernel.act_quant_fp8(golden[f"{case}.x"])
            same_bits(codes, golden[f"{case}.fp8.codes"])
            assert torch.equal(scale, golden[f"{case}.fp8.scale"].float())

    def act_quant_shapes() -> None:
        torch.manual_seed(0)
        x = torch.randn(3, 5, 256) * torch.exp2(torch.randint(-20, 20, (3, 5, 1)).float())
        for block in (32, 64, 128):
            codes, scale = kernel.act_quant_fp8(x, block)
            want_codes, want_scale = ops_quant.act_quant_fp8(x, block)
            same_bits(codes, want_codes)
            assert torch.equal(scale, want_scale)
        codes, scale = kernel.act_quant_fp8(x[:, :, :96].bfloat16())  # K = 3 blocks, strided
        same_bits(codes, ops_quant.act_quant_fp8(x[:, :, :96].bfloat16())[0])

    def fake_act_quant() -> None:
        """One pass: codes × scales in the output dtype, bit for bit the twin's (golden inputs:
        every finite bf16 value, adversarial blocks; fp32 rows over 2^±20; bf16 out of fp32)."""
        torch.manual_seed(3)
        wide = torch.randn(7, 160) * torch.exp2(torch.randint(-20, 20, (7, 1)).float())
        for x in (golden["adversarial.x"], golden["allbf16.x"], golden["random.x"], wide):
            same_bits(kernel.fake_act_quant_fp8(x), ops_quant.fake_act_quant_fp8(x))
            want16 = ops_quant.fake_act_quant_fp8(x.float()).bfloat16()
            same_bits(kernel.fake_act_quant_fp8(x, out_dtype=torch.bfloat16), want16)
            assert torch.equal(want16.float(), ops_quant.fake_act_quant_fp8(x.float()))  # exact
        same_bits(kernel.quantized_act_bf16(wide), ops_quant.fake_act_quant_fp8(wide).bfloat16())

    def gemm_golden() -> None:
        for tag in ("exact", "random"):
            x, w, s = (golden[f"gemm.{tag}.{k}"] for k in ("x", "w8", "w8.scale"))
            got = kernel.launch_fp8_linear(x, w, s, out_dtype=torch.float32, config=(16, 32, 4, 1))
            if tag == "exact":
                assert torch.equal(got, golden["gemm.exact.fp8.f32"])
                got16 = kernel.launch_fp8_linear(x, w, s, config=(16, 32, 4, 1))
                assert torch.equal(got16, golden["gemm.exact.fp8.bf16"])
            _within_gemm_bound(got, x, w, s)

    def gemm_odd_shapes() -> None:
        torch.manual_seed(1)
        for m, n, k in ((1, 80, 96), (37, 33, 64), (20, 130, 160)):
            x = torch.randn(m, k).bfloat16()
            w = (torch.randn(n, k) * 64).to(torch.float8_e4m3fn)
            s = torch.randint(120, 130, ops_linear.fp8_scale_shape(n, k), dtype=torch.uint8)
            s = s.view(torch.float8_e8m0fnu)
            got = kernel.launch_fp8_linear(
                x.view(1, m, k), w, s, out_dtype=torch.float32, config=(16, 32, 4, 2)
            )
            assert got.shape == (1, m, n)
            _within_gemm_bound(got[0], x, w, s)

    def gemm_cublas_path() -> None:
        """`dequant_mm` (the large-GEMM path: exact bf16 operands, one bf16 matmul, here CPU's):
        within one bf16 rounding of the twin past the fp32 sums' bound in any order, K·2⁻²⁴·Σ|ab|;
        `fp8_linear` picks it by size and flag."""
        torch.manual_seed(2)
        for m, n, k in ((64, 80, 96), (600, 130, 256)):
            x = torch.randn(m, k).bfloat16()
            w = (torch.randn(n, k) * 64).to(torch.float8_e4m3fn)
            s = torch.randint(118, 124, ops_linear.fp8_scale_shape(n, k), dtype=torch.uint8)
            s = s.view(torch.float8_e8m0fnu)
            got = kernel.dequant_mm(x, w, s)
            want = ops_linear.fp8_linear(x, w, s)
            assert got.shape == want.shape and got.dtype == torch.bfloat16
            a = ops_quant.fake_act_quant_fp8(x.float())
            bound = k * 2.0**-24 * (a.abs() @ ops_linear.dequant_fp8_blocks(w, s).abs().t())
            big = torch.maximum(got.float().abs(), want.float().abs())
            ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(big)))
            assert bool(((got.float() - want.float()).abs() <= bound + ulp).all())
        x, w = torch.randn(600, 96).bfloat16(), torch.zeros(64, 96).to(torch.float8_e4m3fn)
        s = torch.full(ops_linear.fp8_scale_shape(64, 96), 127, dtype=torch.uint8)
        s = s.view(torch.float8_e8m0fnu)
        assert kernel._gemm_backend(x, torch.bfloat16) == "triton"  # the interpreter: Triton
        os.environ[kernel.FP8_GEMM_FLAG] = "cublas"
        try:
            assert kernel._gemm_backend(x[:1], torch.float32) == "cublas"
            assert torch.equal(kernel.fp8_linear(x, w, s), kernel.dequant_mm(x, w, s))
            os.environ[kernel.FP8_GEMM_FLAG] = "fast"
            try:
                kernel.fp8_linear(x, w, s)
                raise AssertionError("a bad flag must be refused")
            except ValueError as e:
                assert "DSV4CP_FP8_GEMM" in str(e)
        finally:
            del os.environ[kernel.FP8_GEMM_FLAG]

    def rows_valid_zeroes_rows() -> None:
        """`rows_valid`: the invalid rows (a non-finite one among them) are zeroed before the
        quantization, on both kernel paths, as the twin zeroes them; the valid rows are the
        unmasked call's, bit for bit."""
        torch.manual_seed(3)
        m, n, k = 37, 64, 96
        x = torch.randn(m, k).bfloat16()
        x[5] = float("nan")
        valid = torch.ones(m, dtype=torch.bool)
        valid[[0, 5, 36]] = False
        w = (torch.randn(n, k) * 64).to(torch.float8_e4m3fn)
        s = torch.randint(118, 124, ops_linear.fp8_scale_shape(n, k), dtype=torch.uint8)
        s = s.view(torch.float8_e8m0fnu)
        want = ops_linear.fp8_linear(x, w, s, rows_valid=valid)
        assert torch.equal(want, ops_linear.fp8_linear(x.masked_fill(~valid[:, None], 0), w, s))
        for got in (
            kernel.fp8_linear(x, w, s, rows_valid=valid),
            kernel.dequant_mm(x, w, s, rows_valid=valid),
        ):
            assert bool((got[~valid] == 0).all())
        same_bits(
            kernel.dequant_mm(x, w, s, rows_valid=valid)[valid], kernel.dequant_mm(x, w, s)[valid]
        )
        same_bits(
            kernel.fp8_linear(x, w, s, rows_valid=valid)[valid], kernel.fp8_linear(x, w, s)[valid]
        )
        try:
            kernel.dequant_mm(x, w, s, rows_valid=valid[1:])
            raise AssertionError("a wrong rows_valid shape must be refused")
        except ValueError as e:
            assert "rows_valid must be bool (37,)" in str(e)

    return {name: fn for name, fn in locals().items() if name in CASES}


if __name__ == "__main__":
    import traceback

    outcome = {}
    for name, case in _child_cases().items():
        try:
            case()  # type: ignore[operator]
            outcome[name] = "ok"
        except Exception:  # report every case, not only the first failure
            outcome[name] = traceback.format_exc()
    print(json.dumps(outcome))
