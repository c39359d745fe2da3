"""kernels/fp8_gemm_gluon compiled for sm_90 without a GPU: m64n256k16 bf16 wgmmas whose A
operand (the decoded weight) is four registers, no local memory, the loader's register grant,
shared memory within Hopper's, and ptxas keeps the wgmmas asynchronous (it serializes them when a
register operand is rewritten under an in-flight wgmma: the reason for the kernel's two register
sets)."""

from __future__ import annotations

import re

import pytest

from dsv4cp.kernels import fp8_gemm_gluon as gemm
from tests.kernels.sm90_tools import assemble_sm90, sass_lines, tool

pytestmark = pytest.mark.skipif(not gemm.HAVE_GLUON, reason="needs Triton's Gluon")

PTXAS = tool("ptxas")
CUOBJDUMP = tool("cuobjdump")


@pytest.mark.parametrize("e8m0", [True, False])
def test_compiles_for_sm90(e8m0: bool) -> None:
    kernel = gemm.compile_fp8_gemm_for_sm90(e8m0)
    ptx = kernel.asm["ptx"]  # type: ignore[attr-defined]
    mmas = re.findall(r"wgmma\.mma_async\.(\S+) \{[^}]*\}, (\{[^}]*\}|%rd\d+)", ptx)
    assert mmas and {shape for shape, _ in mmas} == {"sync.aligned.m64n256k16.f32.bf16.bf16"}
    assert all(re.fullmatch(r"\{%r\d+,%r\d+,%r\d+,%r\d+\}", a) for _, a in mmas), mmas[:2]
    assert "ld.local" not in ptx and "st.local" not in ptx
    grants = {int(v) for v in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx)}
    assert gemm.LOAD_REGS in grants
    assert kernel.metadata.shared <= 227 * 1024  # type: ignore[attr-defined]


@pytest.mark.skipif(PTXAS is None, reason="no ptxas")
def test_ptxas_keeps_the_wgmmas_asynchronous() -> None:
    ptx = gemm.compile_fp8_gemm_for_sm90(True).asm["ptx"]  # type: ignore[attr-defined]
    assert PTXAS is not None
    res = assemble_sm90(ptx, PTXAS, verbose=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "serialized" not in res.stderr, res.stderr[-2000:]


@pytest.mark.skipif(CUOBJDUMP is None, reason="no cuobjdump")
def test_no_local_memory_between_the_wgmmas() -> None:
    """The MMA warpgroups' loop (first to last HGMMA in the SASS) never touches local memory.
    (Triton 3.8's ptxas spills 64 B of the loader's copy addresses around the partitions'
    register hand-over, before its loop; the device's Triton 3.6 spills nothing: §35.)"""
    cubin = gemm.compile_fp8_gemm_for_sm90(True).asm["cubin"]  # type: ignore[attr-defined]
    assert CUOBJDUMP is not None
    sass = sass_lines(cubin, CUOBJDUMP)
    mma = [i for i, line in enumerate(sass) if "HGMMA" in line]
    assert len(mma) == 6, len(mma)  # two k16 halves × (pair's two steps + the odd step)
    local = [line for line in sass[mma[0] : mma[-1]] if re.search(r"\b(LDL|STL)\b", line)]
    assert not local, local[:4]


@pytest.mark.parametrize(
    ("m", "n", "k", "width"),
    [(2048, 32768, 1280, 1), (2048, 1792, 5120, 1), (2048, 5120, 8192, 16),
     (16384, 32768, 1280, 102), (16384, 1792, 5120, 14), (1 << 20, 100, 8192, 1)],
)  # fmt: skip
def test_group_width(m: int, n: int, k: int, width: int) -> None:
    """Token tile fastest while the activation fits in L2; else weight tiles of ≤ 16 MiB a group,
    at most every tile."""
    assert gemm.group_width(m, n, k) == width
