"""kernels/norm_rope compiled for sm_90 here (no GPU): the RoPE columns move as whole vectors.

The integer arguments carry the divisibility by 16 that Triton's launcher gives them at the real
shapes (strides 512 / 64 / 5120, D 64 / 128 / 512), as a launch would specialize them. The q tail
(the row kernel with the norm off), the qat index queries (fake quant: the row's own pairs split
in registers) and the SWA key (norm + RoPE of the last 64 of 512) must load and store their rows
without any 2-byte global access: the (even, odd) pairs were once read and written one element
at a time (docs/performance.md §9).
"""

from __future__ import annotations

import re
from typing import Any

import pytest

pytestmark = pytest.mark.slow

TYPES = ["*bf16"] * 4 + ["*fp32", "*i64", "*i64", "*fp32", "*i64", "*i64", "*bf16", "*bf16"]
TYPES += ["i32", "i32", "i32", "fp32"] + ["i32"] * 6
BASE = dict(
    POOL=False, POOL_ROWS=False, SRC_ROWS=False, ROUND_IN=False, NORM=False, HAS_W=False,
    ROUND_MID=False, ROPE=True, INVERSE=False, HAS_SLOTS=False, WRITE_MID=False, QUANT=0, QBLOCK=16,
    ENCODE=False, BLOCK_T=8, BLOCK_D=64, BLOCK_R=32, PRECISE=True, EMULATE=False,
)  # fmt: skip


def _ptx(const: dict[str, Any], warps: int, types: list[str] = TYPES) -> str:
    pytest.importorskip("triton")
    import triton.language as tl

    from dsv4cp.kernels.norm_rope import _norm_rope_kernel as fn
    from tests.kernels.test_indexer_topk_compile import _compile

    const = {**BASE, "RDT": tl.bfloat16, **const}
    hinted = [
        name
        for name in fn.arg_names[: len(types)]
        if name.endswith("_ptr") or name.startswith("stride") or name in ("T", "D", "ROPE0")
    ]
    return _compile(fn, types, const, warps, 1, divisible=hinted)


@pytest.mark.parametrize(
    ("what", "const", "warps"),
    [
        ("q tail", {}, 1),
        ("index queries, qat", dict(QUANT="fp4", BLOCK_D=128, BLOCK_T=4), 2),
        ("swa key", dict(NORM=True, HAS_W=True, ROUND_MID=True, BLOCK_D=512), 4),
        ("swa key, qat", dict(NORM=True, HAS_W=True, ROUND_MID=True, BLOCK_D=512, QUANT="fp8"), 4),
    ],
)
def test_rope_rows_move_as_vectors(what: str, const: dict[str, Any], warps: int) -> None:
    from dsv4cp.kernels.fake_quant import FAKE_QUANTS

    if "QUANT" in const:
        quant, qblock = FAKE_QUANTS[const["QUANT"]]
        const = {**const, "QUANT": quant, "QBLOCK": qblock}
    ptx = _ptx(const, warps)
    narrow = re.findall(r"(?:ld|st)\.global(?:\.nc)?\.b16", ptx)
    assert not narrow, f"{what}: {len(narrow)} 2-byte global accesses"
    assert re.search(r"ld\.global(?:\.nc)?\.v4\.b32", ptx), f"{what}: no 16-byte loads"
    assert re.search(r"st\.global\.v4\.b32", ptx), f"{what}: no 16-byte stores"


@pytest.mark.parametrize(
    ("what", "quant", "block_d", "block_t", "warps", "codes"),
    [
        ("swa key, fp8 codes", "fp8", 512, 8, 4, r"st\.global\.v4\.b32"),
        ("compressed key, fp4 + e4m3", "fp4_e4m3", 512, 8, 4, r"st\.global\.v2\.b32"),
    ],
)
def test_encoded_codes_move_as_vectors(
    what: str, quant: str, block_d: int, block_t: int, warps: int, codes: str
) -> None:
    """The encoded rows (uint8; `kv_encode.store_encoded`): the codes leave as vectors, only the
    scale bytes (one per block) as single bytes."""
    from dsv4cp.kernels.fake_quant import FAKE_QUANTS

    q, qblock = FAKE_QUANTS[quant]
    const = dict(
        NORM=True, HAS_W=True, ROUND_MID=True, HAS_SLOTS=True, BLOCK_D=block_d,
        BLOCK_T=block_t, QUANT=q, QBLOCK=qblock, ENCODE=True,
    )  # fmt: skip
    types = list(TYPES)
    types[10] = "*u8"  # out: the cache's rows
    ptx = _ptx(const, warps, types)
    assert re.search(codes, ptx), f"{what}: codes not stored as vectors"
    assert len(re.findall(r"st\.global\.b8", ptx)) <= 2, f"{what}: byte-wise stores"


@pytest.mark.parametrize("src_rows", [False, True])
def test_compressor_reads_pooled_rows_as_vectors(src_rows: bool) -> None:
    """The ratio-2 compressor's pass (fp32 kv | gate pooled with the state's row or the row
    above, latent written, fp4 codes stored), also reading the rows through the all-gather's
    token → row index (`src_rows`): the index only moves which rows load, not how."""
    from dsv4cp.kernels.fake_quant import FAKE_QUANTS

    q, qblock = FAKE_QUANTS["fp4_e4m3"]
    const = dict(
        POOL=True, POOL_ROWS=True, SRC_ROWS=src_rows, ROUND_IN=True, NORM=True, HAS_W=True,
        ROUND_MID=True, HAS_SLOTS=True, WRITE_MID=True, BLOCK_D=512, BLOCK_T=8, QUANT=q,
        QBLOCK=qblock, ENCODE=True,
    )  # fmt: skip
    types = ["*fp32"] * 4 + list(TYPES[4:])
    types[10] = "*u8"
    ptx = _ptx(const, 4, types)
    assert len(re.findall(r"ld\.global(?:\.nc)?\.v4\.b32", ptx)) >= 4, "rows not loaded as vectors"
    assert re.search(r"st\.global\.v2\.b32", ptx), "codes not stored as vectors"
