"""kernels/fp8_gemm_gluon_regs compiled for sm_90 without a GPU: m64n256k16 bf16 wgmmas whose A
operand (the decoded weight) is four registers, no local memory, shared memory within Hopper's,
and ptxas keeps the wgmmas asynchronous (it serializes them when a register operand is rewritten
under an in-flight wgmma: the reason for the kernel's two register sets)."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import triton

from dsv4cp.kernels import fp8_gemm_gluon_regs as gemm

pytestmark = pytest.mark.skipif(not gemm.HAVE_GLUON, reason="needs Triton's Gluon")

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.parametrize("e8m0", [True, False])
def test_compiles_for_sm90(e8m0: bool) -> None:
    kernel = gemm.compile_fp8_gemm_regs_for_sm90(e8m0)
    ptx = kernel.asm["ptx"]  # type: ignore[attr-defined]
    mmas = re.findall(r"wgmma\.mma_async\.(\S+) \{[^}]*\}, (\{[^}]*\}|%rd\d+)", ptx)
    assert mmas and {shape for shape, _ in mmas} == {"sync.aligned.m64n256k16.f32.bf16.bf16"}
    assert all(re.fullmatch(r"\{%r\d+,%r\d+,%r\d+,%r\d+\}", a) for _, a in mmas), mmas[:2]
    assert "ld.local" not in ptx and "st.local" not in ptx
    grants = {int(v) for v in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx)}
    assert gemm.LOAD_REGS in grants
    assert kernel.metadata.shared <= 227 * 1024  # type: ignore[attr-defined]


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton ships no ptxas")
def test_ptxas_keeps_the_wgmmas_asynchronous() -> None:
    ptx = gemm.compile_fp8_gemm_regs_for_sm90(True).asm["ptx"]  # type: ignore[attr-defined]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run(
            [str(PTXAS), "-v", "--gpu-name=sm_90a", str(src), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
        )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "serialized" not in res.stderr, res.stderr[-2000:]
    assert "0 bytes spill stores, 0 bytes spill loads" in res.stderr
