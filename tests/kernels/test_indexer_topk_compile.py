"""The fused indexer kernels compile for Hopper (sm_90) on a machine without a GPU.

Triton lowers a kernel to PTX without a device, and its bundled ptxas assembles it, so a kernel
that would not compile on the H200 fails here first. The scan kernel must issue wgmma (the logits
on Hopper's tensor cores), in each of its three modes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from tests.kernels.sm90_tools import assemble_sm90, tool

triton = pytest.importorskip("triton")

pytestmark = pytest.mark.slow


def _compile(
    fn: Any,
    types: list[str],
    const: dict[str, Any],
    warps: int,
    stages: int,
    divisible: Sequence[str] = (),
) -> str:
    """sm_90 PTX of `fn` (checked by ptxas when it is there). `divisible`: argument names given
    the divisibility by 16 that a launch specializes at real shapes (it decides vector widths)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(zip(fn.arg_names, types + ["constexpr"] * len(const)))
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    try:
        kernel = triton.compile(
            ASTSource(fn, sig, constexprs=const, attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=warps, num_stages=stages),
        )
    except (ImportError, RuntimeError) as exc:  # no CUDA backend in this triton build
        if "backend" in str(exc).lower():
            pytest.skip(f"triton cannot target CUDA here: {exc}")
        raise
    ptx = kernel.asm["ptx"]
    ptxas = tool("ptxas")
    if ptxas:
        res = assemble_sm90(ptx, ptxas)
        assert res.returncode == 0, res.stderr[-2000:]
    return ptx


SCAN_TYPES = ["*bf16", "*fp32", "*bf16", "*i64", "*i64", "*u8", "*fp32"] + ["*i32"] * 6 + ["*i8"]
SCAN_TYPES += ["*i8", "*fp32", "*i8", "*i8", "*fp32", "*i8"]  # the int8 operands (INT8)
SCAN_TYPES += ["i32"] * 12


def _scan_ptx(
    member: bool,
    block_max: bool,
    qat: bool,
    packed: bool = True,
    direct: bool = True,
    seed: tuple[int, bool, bool] = (1, False, False),
    int8: bool = False,
    relu_fma: bool = False,
) -> str:
    """sm_90 PTX of the scan kernel at the shipped config and Flash's index shapes; `direct`
    False: a piece of several whose buffer goes to the merge as it is (no last cut); `seed`:
    (COL_STRIDE, SEEDED, REDO); `int8`: the int8 head loop where a tile allows it (convert
    "magic", or cvt with `relu_fma`)."""
    from dsv4cp.kernels import indexer_topk as m
    from dsv4cp.kernels.indexer_topk_scan import scan_kernel

    block_t, block_n, warps, stages = m.DEFAULT_CONFIG
    const = dict(
        K=512, K_PAD=512, CAP=1024, RG=4, HAS_KSTART=True, MEMBER=member, BLOCK_MAX=block_max,
        BS=8, DIRECT=direct, PREFIX=not member, FINAL_CUT=direct, D=128, BLOCK_T=block_t,
        BLOCK_N=block_n, STAGES=stages, UPCAST=False, DOT_PREC="tf32", QAT=qat, RNE=False,
        PACKED=packed, KEY_BITS=16 if qat else 32, COL_STRIDE=seed[0], SEEDED=seed[1],
        REDO=seed[2], INT8=int8, CVT=relu_fma, RELU_FMA=relu_fma,
    )  # fmt: skip
    return _compile(scan_kernel, SCAN_TYPES, const, warps, stages)


@pytest.mark.parametrize(
    ("member", "block_max", "qat"),
    [(False, False, False), (False, True, False), (True, False, False)]
    + [(False, False, True), (False, True, True), (True, False, True)],
)
def test_scan_kernel_compiles_for_sm90(member: bool, block_max: bool, qat: bool) -> None:
    ptx = _scan_ptx(member, block_max, qat)
    assert "wgmma.mma_async" in ptx
    if qat:  # the bf16 steps two values per instruction; single roundings only for the weights
        assert "mul.rn.bf16x2" in ptx and "cvt.rn.bf16x2.f32" in ptx
        assert ptx.count("cvt.rn.bf16.f32") <= 4, ptx.count("cvt.rn.bf16.f32")


def test_scan_piece_without_its_last_cut_compiles_for_sm90() -> None:
    assert "wgmma.mma_async" in _scan_ptx(member=False, block_max=False, qat=True, direct=False)


@pytest.mark.parametrize("direct", [True, False])
def test_seeded_scan_and_its_passes_compile_for_sm90(direct: bool) -> None:
    """The seed's sample pass (a column stride), the seeded pass and the redo (early exit)."""
    for seed in ((128, False, False), (1, True, False), (1, False, True)):
        ptx = _scan_ptx(member=False, block_max=True, qat=True, direct=direct, seed=seed)
        assert "wgmma.mma_async" in ptx


@pytest.mark.parametrize("relu_fma", [False, True])
@pytest.mark.parametrize(("member", "block_max"), [(False, False), (False, True), (True, False)])
def test_int8_scan_compiles_for_sm90(member: bool, block_max: bool, relu_fma: bool) -> None:
    """INT8 (`launch_mqa_topk(int8_scan=True)`): s8 wgmma for the tiles whose rows and keys are
    encoded exactly (`indexer_logits_int8.int8_heads`), bf16 wgmma for the others, in each mode;
    the seed's three passes too."""
    seeds = ((1, False, False),) + (((128, False, False), (1, True, False), (1, False, True))
                                    if block_max else ())  # fmt: skip
    for seed in seeds:
        ptx = _scan_ptx(member, block_max, qat=True, seed=seed, int8=True, relu_fma=relu_fma)
        wgmma = [ln for ln in ptx.splitlines() if "wgmma.mma_async" in ln]
        assert any(".s32.s8.s8" in ln for ln in wgmma), wgmma[:2]
        assert any(".bf16.bf16" in ln for ln in wgmma), wgmma[:2]
        assert ("fma.rn.relu.bf16x2" in ptx) == relu_fma
    off = _scan_ptx(member, block_max, qat=True)  # INT8 off: no int8 MMA
    assert ".s8.s8" not in off and "wgmma.mma_async" in off


def test_scan_qat_unpacked_rounds_one_value_per_instruction() -> None:
    """The control of the packed assertion above: PACKED=False (the A/B knob) rounds each of a
    thread's 64 logits per head one at a time, twice."""
    ptx = _scan_ptx(member=False, block_max=False, qat=True, packed=False)
    assert "mul.rn.bf16x2" not in ptx and ptx.count("cvt.rn.bf16.f32") >= 64


@pytest.mark.parametrize("qat", [False, True])
def test_gather_kernel_compiles_for_sm90(qat: bool) -> None:
    from dsv4cp.kernels.indexer_topk_gather import gather_kernel

    types = ["*bf16", "*fp32", "*bf16", "*i64", "*i64"] + ["*i32"] * 6 + ["i32"] * 12
    const = dict(
        K=512, K_PAD=512, CAP=1024, HAS_KSTART=True, D=128, H_PAD=32, BS=8, BPT=16,
        UPCAST=False, DOT_PREC="tf32", QAT=qat, RNE=False, PACKED=True,
        KEY_BITS=16 if qat else 32,
    )  # fmt: skip
    ptx = _compile(gather_kernel, types, const, 4, 2)
    assert "mma" in ptx  # all 32 heads of a row in one tensor-core product


def test_merge_and_member_kernels_compile_for_sm90() -> None:
    from dsv4cp.kernels.indexer_topk_merge import merge_kernel
    from dsv4cp.kernels.indexer_topk_scan import member_kernel

    types = ["*i32", "*i32", "*i32", "*i64", "*i32", "*i8", "i32", "i32", "i32"]
    for bits in (16, 32):  # qat's bf16 scores, fp32's
        # the pieces cut to K (16 of them), or their running buffers as they are (8 of CAP);
        # after a seeded pass (FLAG) or as its redo (REDO)
        for p_pad, w_pad, flag, redo in ((16, 512, 0, 0), (8, 1024, 1, 0), (8, 1024, 0, 1)):
            const = dict(
                K=512, K_PAD=512, P_PAD=p_pad, CAP=1024, W_PAD=w_pad, PREFIX=True, KEY_BITS=bits,
                FLAG=bool(flag), REDO=bool(redo),
            )  # fmt: skip
            _compile(merge_kernel, types, const, 8, 1)
    _compile(member_kernel, ["*i32", "*u8", "i32", "i32", "i32"], dict(MB_PAD=2048), 4, 1)


@pytest.mark.parametrize("fmt", [1, 2, 3])
def test_workspace_decode_compiles_for_sm90(fmt: int) -> None:
    """The bounded workspace's fill (FlashMLA's bf16 rows, the fused indexer's keys)."""
    from dsv4cp.kernels import kv_decode as m

    d = 128 if fmt == 3 else 512
    const = dict(D=d, D_PAD=d, BLOCK_R=16, FMT=fmt, RNE=False)
    _compile(m._decode_gather_kernel, ["*u8", "*i32", "*bf16", "i32", "i32", "i32"], const, 4, 1)


def test_workspace_numbering_compiles_for_sm90() -> None:
    """The workspace's row marks and index remap (`workspace_rows`), int32 and int64 indices."""
    from dsv4cp.kernels import workspace_rows as m

    const = dict(BT=m.BLOCK_T, BK=m.BLOCK_K)
    for idx in ("*i32", "*i64"):
        _compile(m._mark_kernel, [idx, "*i32"] + ["i32"] * 4, const, 4, 1)
        _compile(m._remap_kernel, [idx, "*i32", "*i32"] + ["i32"] * 7, const, 4, 1)


@pytest.mark.parametrize("qat", [False, True])
def test_cached_logits_kernel_compiles_for_sm90(qat: bool) -> None:
    """`indexer_logits_cached` shares the heads loop (`index_score.add_heads`, its pipelining
    left to the compiler) with the scan kernel: fp4 index keys decoded on load, bf16 wgmma."""
    from dsv4cp.kernels import indexer_logits_cached as m
    from dsv4cp.kernels.kv_decode import FORMAT_CODES

    block_t, block_n, warps, stages = m.DEFAULT_CONFIG
    types = ["*bf16", "*fp32", "*u8", "*i64", "*i32", "*i32", "*fp32"] + ["i32"] * 9
    const = dict(
        D=128, H_PAD=64, BLOCK_T=block_t, BLOCK_N=block_n, FMT=FORMAT_CODES["fp4_ue8m0_32"],
        QAT=qat, UPCAST=False, DOT_PREC="tf32", RNE=False, PACKED=True,
    )  # fmt: skip
    ptx = _compile(m._mqa_logits_cached_kernel, types, const, warps, stages)
    assert "wgmma.mma_async" in ptx


def _logits_ptx(qat: bool, packed: bool) -> str:
    """sm_90 PTX of `indexer_logits`' tile kernel as the logits route launches it (its shipped
    config, the hidden logits unwritten)."""
    from dsv4cp.kernels import indexer_logits as m

    block_t, block_n, warps, stages = m.DEFAULT_CONFIG
    types = ["*bf16", "*fp32", "*bf16", "*i64", "*i64", "*fp32"] + ["i32"] * 9
    const = dict(
        HAS_KSTART=True, D=128, BLOCK_T=block_t, BLOCK_N=block_n, STAGES=stages, UPCAST=False,
        DOT_PREC="tf32", QAT=qat, EMULATE=False, PACKED=packed, FILL=False,
    )  # fmt: skip
    return _compile(m._mqa_logits_kernel, types, const, warps, stages)


@pytest.mark.parametrize("qat", [False, True])
def test_logits_kernel_compiles_for_sm90(qat: bool) -> None:
    """The logits route's kernel shares the heads loop and the packed qat steps with the scan."""
    ptx = _logits_ptx(qat, packed=True)
    assert "wgmma.mma_async" in ptx
    if qat:
        assert "mul.rn.bf16x2" in ptx and "cvt.rn.bf16x2.f32" in ptx
        assert ptx.count("cvt.rn.bf16.f32") <= 4, ptx.count("cvt.rn.bf16.f32")


def test_logits_kernel_unpacked_rounds_one_value_per_instruction() -> None:
    ptx = _logits_ptx(qat=True, packed=False)
    assert "mul.rn.bf16x2" not in ptx and ptx.count("cvt.rn.bf16.f32") >= 64


@pytest.mark.parametrize("k_start", [False, True])
def test_int8_logits_kernels_compile_for_sm90(k_start: bool) -> None:
    """The logits route's qat kernel on int8 MMAs (`indexer_logits_int8`, its shipped config):
    s8 wgmma for the exact path, bf16 wgmma for the per-tile branch, the int32 sums made fp32
    by the magic-number add (shipped) or by cvt; the encoding kernel for queries and keys."""
    from dsv4cp.kernels import indexer_logits_int8 as m

    block_t, block_n, warps, stages = m.DEFAULT_CONFIG
    types = ["*i8", "*fp32", "*i8", "*i8", "*fp32", "*i8", "*bf16", "*fp32", "*bf16", "*i32"]
    types += ["*i64" if k_start else "*i32", "*fp32"] + ["i32"] * 9
    for cvt, relu_fma in ((False, False), (True, False), (True, True)):
        const = dict(
            HAS_KSTART=k_start, D=128, BLOCK_T=block_t, BLOCK_N=block_n, STAGES=stages,
            EMULATE=False, PACKED=True, FILL=False, CVT=cvt, RELU_FMA=relu_fma,
        )  # fmt: skip
        ptx = _compile(m._mqa_logits_int8_kernel, types, const, warps, stages)
        wgmma = [ln for ln in ptx.splitlines() if "wgmma.mma_async" in ln]
        assert any(".s32.s8.s8" in ln for ln in wgmma), wgmma[:2]
        assert any(".bf16.bf16" in ln for ln in wgmma), wgmma[:2]
        assert ("cvt.rn.f32.s32" in ptx) == cvt  # "magic": the add, no conversion
        assert ("fma.rn.relu.bf16x2" in ptx) == relu_fma  # the bf16 branch: max and mul
    for has_w in (False, True):
        types = ["*bf16", "*fp32", "*i8", "*fp32", "*fp32", "*i8", "i32", "i32"]
        const = dict(E_LIM=m.E_LIMIT, D=128, G_PAD=32, HAS_W=has_w, EMULATE=False)
        _compile(m._encode_kernel, types, const, 4, 1)


@pytest.mark.parametrize("bits", [16, 32])
def test_topk_selection_kernels_compile_for_sm90(bits: int) -> None:
    """`kernels/topk`'s selections (the logits route's and the candidate blocks': by slots and
    by streaming, `topk_stream`), both searches."""
    from dsv4cp.kernels import topk as m
    from dsv4cp.kernels import topk_stream

    ptrs = ["*fp32", "*i32", "*i32"]
    piece = dict(K=512, BLOCK=16384, KEY_BITS=bits)  # merge="stream"
    _compile(topk_stream._piece_kth_kernel, ptrs + ["i32"] * 3, piece, 8, 1)
    cand = dict(K=512, OUT_BLOCK=512, P_BLOCK=16, STREAM_BLOCK=4096, CAP=4096, KEY_BITS=bits)
    _compile(topk_stream._topk_candidates_kernel, ptrs + ["*i32"] * 3 + ["i32"] * 4, cand, 4, 1)
    for block in (4096, 8192):  # merge="slots"; 16-bit keys: the bf16-pair search, as launched
        sel = dict(K=512, OUT_BLOCK=512, BLOCK=block, SUB=2048, KEY_BITS=bits)
        sel |= dict(PACKED=bits == 16, EMULATE=False)
        ptx = _compile(m._piece_select_kernel, ptrs + ["*i32"] * 2 + ["i32"] * 4, sel, 4, 1)
        assert ("set.ge.u32.bf16x2" in ptx) == (bits == 16)
    merge = dict(K=512, OUT_BLOCK=512, M_BLOCK=4096, KEY_BITS=bits)
    _compile(m._topk_merge_kernel, ["*i32"] * 4 + ["i32"] * 4, merge, 4, 1)
