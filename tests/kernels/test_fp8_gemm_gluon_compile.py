"""kernels/fp8_gemm_gluon compiled for sm_90 without a GPU: the partitions' register grants,
one m64n256k16 bf16 wgmma pair per K step, no local memory, shared memory within Hopper's."""

from __future__ import annotations

import re

import pytest

from dsv4cp.kernels import fp8_gemm_gluon as gemm

pytestmark = pytest.mark.skipif(not gemm.HAVE_GLUON, reason="needs Triton's Gluon")


@pytest.mark.parametrize("e8m0", [True, False])
def test_compiles_for_sm90(e8m0: bool) -> None:
    kernel = gemm.compile_fp8_gemm_for_sm90(e8m0)
    ptx = kernel.asm["ptx"]  # type: ignore[attr-defined]
    assert set(re.findall(r"wgmma\.mma_async\.\S+", ptx)) == {
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16"
    }
    assert ptx.count("wgmma.mma_async") == gemm.BK // 16
    assert "ld.local" not in ptx and "st.local" not in ptx
    grants = {int(v) for v in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx)}
    assert gemm.FEED_REGS in grants
    assert kernel.metadata.shared <= 227 * 1024  # type: ignore[attr-defined]
