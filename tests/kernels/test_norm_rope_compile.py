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

TYPES = ["*bf16"] * 4 + ["*fp32", "*fp32", "*i64", "*i64", "*bf16", "*bf16"]
TYPES += ["i32", "i32", "i32", "fp32"] + ["i32"] * 6
BASE = dict(
    POOL=False, ROUND_IN=False, NORM=False, HAS_W=False, ROUND_MID=False, ROPE=True,
    INVERSE=False, HAS_SLOTS=False, WRITE_MID=False, QUANT=0, QBLOCK=16, BLOCK_T=8, BLOCK_D=64,
    BLOCK_R=32, PRECISE=True, EMULATE=False,
)  # fmt: skip


def _ptx(const: dict[str, Any], warps: int) -> str:
    pytest.importorskip("triton")
    import triton.language as tl

    from dsv4cp.kernels.norm_rope import _norm_rope_kernel as fn
    from tests.kernels.test_indexer_topk_compile import _compile

    const = {**BASE, "RDT": tl.bfloat16, **const}
    hinted = [
        name
        for name in fn.arg_names[: len(TYPES)]
        if name.endswith("_ptr") or name.startswith("stride") or name in ("T", "D", "ROPE0")
    ]
    return _compile(fn, TYPES, const, warps, 1, divisible=hinted)


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
