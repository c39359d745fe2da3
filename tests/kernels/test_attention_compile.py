"""The Triton sparse attention kernel compiled for sm_90 at Flash dims (D 512, 64 heads): every
cache-format pair the launcher takes, in both numerics, fits Hopper's shared memory with the
stages `pipeline_stages` picks. Compiled with divisibility hints on pointers and strides, as a
real launch specializes them (cp.async pipelining, which doubles the K tiles, needs them): the
H200 refused qat over two dense sources (257 KB) before `pipeline_stages` existed."""

from __future__ import annotations

import pytest

HOPPER_SMEM = 232448  # bytes per block, sm_90 (227 KB)


def _shared_bytes(
    swa_fmt: int, comp_fmt: int, qat: bool, stages: int, ones: tuple[str, ...] = ()
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
                 COMP_FMT=comp_fmt, UPCAST=False, DOT_PREC="tf32", QAT=qat, RNE=False)  # fmt: skip
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
def test_launch_config_fits_hopper_shared_memory(swa: str, comp: str, qat: bool) -> None:
    from dsv4cp.kernels.attention import DEFAULT_CONFIG, FORMAT_CODES, pipeline_stages

    s, c = FORMAT_CODES[swa], FORMAT_CODES[comp]
    stages = pipeline_stages(DEFAULT_CONFIG[2], s, c, qat)
    assert _shared_bytes(s, c, qat, stages) <= HOPPER_SMEM


def test_the_refused_config_is_what_the_stage_rule_avoids() -> None:
    """Witness: two stages of qat over dense rows exceed the limit (what the H200 refused)."""
    assert _shared_bytes(0, 0, True, 2) > HOPPER_SMEM


def test_counts_of_one_are_not_compiled_as_constants() -> None:
    """A launch with one index per query (or one cache row) must not specialise the count to a
    constant: Triton 3.6 then pipelines the one-trip loop into 262 KB of shared memory at Flash
    dims (the H100 refused such a launch). The kernel's JIT keeps these counts runtime values."""
    pytest.importorskip("triton")
    from dsv4cp.kernels.attention import _sparse_attention_kernel

    counts = ("N_SWA", "N_COMP", "NUM_SWA_IDX", "NUM_COMP_IDX")
    kept = {p.name for p in _sparse_attention_kernel.params if p.do_not_specialize}
    assert set(counts) <= kept
    # witness: one index per query, its count compiled as 1, does not fit (262,400 B)
    from dsv4cp.kernels.attention import DEFAULT_CONFIG, pipeline_stages

    stages = pipeline_stages(DEFAULT_CONFIG[2], 0, 0, False)
    assert _shared_bytes(0, 0, False, stages) <= HOPPER_SMEM
    assert _shared_bytes(0, 0, False, stages, ones=("NUM_SWA_IDX",)) > HOPPER_SMEM
