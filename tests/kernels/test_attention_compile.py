"""The Triton sparse attention kernel compiled for sm_90 at Flash dims (D 512, 64 heads): every
cache-format pair the launcher takes, in both numerics, fits Hopper's shared memory with the
stages `pipeline_stages` picks. Compiled with divisibility hints on pointers and strides, as a
real launch specializes them (cp.async pipelining, which doubles the K tiles, needs them): the
H200 refused qat over two dense sources (257 KB) before `pipeline_stages` existed."""

from __future__ import annotations

import pytest

HOPPER_SMEM = 232448  # bytes per block, sm_90 (227 KB)


def _shared_bytes(
    swa_fmt: int,
    comp_fmt: int,
    qat: bool,
    stages: int,
    ones: tuple[str, ...] = (),
    one_list: bool = False,
) -> int:
    """The kernel's shared bytes; `ones`: runtime ints compiled as the constant 1 (what Triton's
    JIT does to a 1 unless the parameter is `do_not_specialize`)."""
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsv4cp.kernels.attention import DEFAULT_CONFIG, _sparse_attention_kernel

    fn = _sparse_attention_kernel
    rows = {0: "*bf16"}  # dense caches hold q.dtype rows; quantized ones uint8 rows
    types = ["*bf16", rows.get(swa_fmt, "*u8"), "*i32", rows.get(comp_fmt, "*u8"), "*i32"]
    types += ["*fp32", "*bf16"] + ["i32"] * 5 + ["fp32"] + ["i32"] * 8
    const = dict(D=512, D_PAD=512, BLOCK_H=64, BLOCK_N=DEFAULT_CONFIG[0], SWA_FMT=swa_fmt,
                 COMP_FMT=comp_fmt, UPCAST=False, DOT_PREC="tf32", QAT=qat, ONE_LIST=one_list,
                 RNE=False)  # fmt: skip
    sig = dict(zip(fn.arg_names, types + ["constexpr"] * len(const)))
    for name in ones:
        sig[name] = "constexpr"
        const[name] = 1
    hinted = [i for i, n in enumerate(fn.arg_names[: len(types)])
              if types[i].startswith("*") or n.startswith("stride")]  # fmt: skip
    attrs = {(i,): [["tt.divisibility", 16]] for i in hinted}
    try:
        kernel = triton.compile(
            ASTSource(fn, sig, constexprs=const, attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=DEFAULT_CONFIG[1], num_stages=stages),
        )
    except (ImportError, RuntimeError) as exc:  # no CUDA backend in this triton build
        if "backend" in str(exc).lower():
            pytest.skip(f"triton cannot target CUDA here: {exc}")
        raise
    return int(kernel.metadata.shared)


@pytest.mark.parametrize("qat", [False, True], ids=["none", "qat"])
@pytest.mark.parametrize(
    ("swa", "comp"),
    [("dense", "dense"), ("fp8_ue8m0_32", "dense"), ("fp8_ue8m0_32", "fp4_e4m3_16")],
    ids=["dense", "fp8-swa-only", "fp8-fp4"],
)
@pytest.mark.parametrize("one_list", [False, True], ids=["two-lists", "one-list"])
def test_launch_config_fits_hopper_shared_memory(
    swa: str, comp: str, qat: bool, one_list: bool
) -> None:
    """`one_list`: no compressed list (SWA-only layers; the workspace route in qat), where qat
    walks the one list like the dense kernel and keeps two stages."""
    from dsv4cp.kernels.attention import DEFAULT_CONFIG, FORMAT_CODES, pipeline_stages

    s, c = FORMAT_CODES[swa], FORMAT_CODES[comp]
    stages = pipeline_stages(DEFAULT_CONFIG[2], s, c, qat, one_list)
    assert stages == (1 if qat and swa == comp == "dense" and not one_list else 2)
    assert _shared_bytes(s, c, qat, stages, one_list=one_list) <= HOPPER_SMEM


def test_the_refused_config_is_what_the_stage_rule_avoids() -> None:
    """Witness: two stages of qat over dense rows exceed the limit (what the H200 refused)."""
    assert _shared_bytes(0, 0, True, 2) > HOPPER_SMEM


def test_no_count_of_one_pads_where_a_one_trip_loop_would_be_compiled() -> None:
    """Triton's JIT compiles an int argument of 1 as a constant; a one-index list made a one-trip
    loop that Triton 3.6 pipelined into 262 KB of shared memory at Flash dims (the H100 refused
    that launch). The launcher appends a skipped −1 to such a list instead of giving up the
    counts' divisibility specialisation (which the cached kernel's speed needs, §25); the row
    counts only bound masks and are never specialised."""
    import torch

    from dsv4cp.kernels.attention import _sparse_attention_kernel, no_count_of_one

    kept = {p.name for p in _sparse_attention_kernel.params if p.do_not_specialize}
    assert kept == {"N_SWA", "N_COMP"}
    one = torch.tensor([[5], [-1]], dtype=torch.int32)
    none = one[:, :0]
    pad = torch.tensor([[5, -1], [-1, -1]], dtype=torch.int32)
    for qat in (False, True):
        s, c = no_count_of_one(one, none, qat)
        assert torch.equal(s, pad) and c.shape == (2, 0)
        s, c = no_count_of_one(one, one, qat)
        assert torch.equal(c, pad)  # the list's end: no index moves
        # qat walks 64-key blocks over [SWA | compressed]: a column between would move them
        assert torch.equal(s, one if qat else pad)
    wide = torch.zeros(2, 3, dtype=torch.int32)
    assert no_count_of_one(wide, none, False)[0] is wide


def test_a_count_of_one_is_what_overflows_and_qat_keeps_it_fitting() -> None:
    """Witness: the dense kernel with its SWA count compiled as 1 does not fit (262,400 B), the
    runtime count does. The one 1 the launcher still passes, qat's SWA count before a compressed
    list, is part of the concatenated loop's trip count and fits for every format pair."""
    from dsv4cp.kernels.attention import DEFAULT_CONFIG, FORMAT_CODES, pipeline_stages

    stages = pipeline_stages(DEFAULT_CONFIG[2], 0, 0, False)
    assert _shared_bytes(0, 0, False, stages) <= HOPPER_SMEM
    assert _shared_bytes(0, 0, False, stages, ones=("NUM_SWA_IDX",)) > HOPPER_SMEM
    for swa, comp in (("dense", "dense"), ("fp8_ue8m0_32", "fp4_e4m3_16")):
        s, c = FORMAT_CODES[swa], FORMAT_CODES[comp]
        stages = pipeline_stages(DEFAULT_CONFIG[2], s, c, True)
        assert _shared_bytes(s, c, True, stages, ones=("NUM_SWA_IDX",)) <= HOPPER_SMEM
