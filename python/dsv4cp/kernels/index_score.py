"""One head's term of an index score and the head sum as the score, in Triton registers.

The indexer kernels (`indexer_topk_scan`, `indexer_topk_gather`, `indexer_logits_cached`,
`indexer_logits`) form
each logit as Σ_h relu(q_h·k)·w_h. quant="qat" (QAT constexpr): each head's term is the
reference's bf16 steps, bf16(relu(bf16(s)) · bf16(w)), added in fp32 in head order 0…H−1 (the
row-by-row paths: a tree over the heads) and the sum rounded to bf16 once: the index scores of
`ops.attention_quant.index_scores_qat`. The fp4 × fp4 products are exact and the fp32 dot of D_I
of them is exact unless the block scales differ by about 2^10, so the scores equal the twin's but
where that sum rounds; on one GPU the selection is a deterministic function of each row (CP = N
equals CP = 1 bit for bit).

PACKED (GPU only, sm_90): the qat steps two values at a time in inline PTX — one
`cvt.rn.bf16x2.f32` rounds a pair of logits, `max.bf16x2` is the relu and `mul.rn.bf16x2` the
product by the bf16 weight, rounded once (the product of two bf16 values is exact in fp32, so
this is bf16(relu(bf16(s)) · bf16(w)) bit for bit). Unpacked, the PTX rounds one value per
`cvt.rn.bf16.f32`; ptxas pairs the head terms' roundings itself but shuffles the halves (`PRMT`,
484 against 381 SASS instructions per head in the scan) and leaves the head sum's roundings
single (`F2F`, a quarter-rate pipe; docs/performance.md §10). The CPU interpreter has no inline
asm: RNE (interpreting) takes the bit-level rounding instead.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4cp.kernels._triton import to_dtype


@triton.jit
def _term_bf16x2(s, wb):
    """bf16(relu(bf16(s)) · wb) as fp32, two values per asm block (wb: bf16 weights)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 p, z;
        mov.b32 z, 0;
        cvt.rn.bf16x2.f32 p, $3, $2;
        max.bf16x2 p, p, z;
        mul.rn.bf16x2 p, p, $4;
        shl.b32 $0, p, 16;
        and.b32 $1, p, 0xFFFF0000;
        }""",
        constraints="=r,=r,r,r,r",
        args=[s, wb],
        dtype=tl.float32,
        is_pure=True,
        pack=2,
    )


@triton.jit
def _round_bf16x2(x):
    """fp32 → the nearest bf16 (ties to even) as fp32, two values per asm block."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 p;
        cvt.rn.bf16x2.f32 p, $3, $2;
        shl.b32 $0, p, 16;
        and.b32 $1, p, 0xFFFF0000;
        }""",
        constraints="=r,=r,r,r",
        args=[x],
        dtype=tl.float32,
        is_pure=True,
        pack=2,
    )


@triton.jit
def head_term(s, w, QAT: tl.constexpr, RNE: tl.constexpr, PACKED: tl.constexpr):
    """One head's relu(s)·w in fp32, or the reference's bf16 steps under qat:
    bf16(relu(bf16(s)) · bf16(w)) (`ops.attention_quant.index_scores_qat`)."""
    if QAT and PACKED and not RNE:
        return _term_bf16x2(s, w.to(tl.bfloat16))
    elif QAT:
        sb = to_dtype(s, tl.bfloat16, RNE).to(tl.float32)
        wb = to_dtype(w, tl.bfloat16, RNE).to(tl.float32)
        return to_dtype(tl.maximum(sb, 0.0) * wb, tl.bfloat16, RNE).to(tl.float32)
    else:
        return tl.maximum(s, 0.0) * w


@triton.jit
def index_score(acc, QAT: tl.constexpr, RNE: tl.constexpr, PACKED: tl.constexpr):
    """The head sum as the index score: one bf16 rounding under qat."""
    if QAT and PACKED and not RNE:
        return _round_bf16x2(acc)
    elif QAT:
        return to_dtype(acc, tl.bfloat16, RNE).to(tl.float32)
    else:
        return acc


@triton.jit
def add_heads(
    acc,
    q_ptrs,
    w_ptrs,
    kt,
    row_mask,
    H,
    stride_qh,
    QAT: tl.constexpr,
    RNE: tl.constexpr,
    PACKED: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    STAGES: tl.constexpr,
):
    """acc + Σ_h head_term(q_h · kt, w_h), heads in order 0…H−1: q_ptrs [rows, D] and w_ptrs
    [rows] point at head 0 (next head: + stride_qh and + 1), kt [D, cols] the key tile, rows
    outside row_mask read zeros; one tensor-core product per head. STAGES: the loop's
    software-pipelining depth (None: the compiler's default). PACKED: see the module docstring."""
    for _ in tl.range(0, H, num_stages=STAGES):
        qh = tl.load(q_ptrs, mask=row_mask[:, None], other=0.0)
        wh = tl.load(w_ptrs, mask=row_mask, other=0.0)
        if UPCAST:
            qh = qh.to(tl.float32)
        s = tl.dot(qh, kt, input_precision=DOT_PREC)
        acc += head_term(s, wh[:, None], QAT, RNE, PACKED)
        q_ptrs += stride_qh
        w_ptrs += 1
    return acc
