"""One head's term of an index score and the head sum as the score, in Triton registers.

The indexer kernels (`indexer_topk_scan`, `indexer_topk_gather`, `indexer_logits_cached`) form
each logit as Σ_h relu(q_h·k)·w_h. quant="qat" (QAT constexpr): each head's term is the
reference's bf16 steps, bf16(relu(bf16(s)) · bf16(w)), added in fp32 in head order 0…H−1 (the
row-by-row paths: a tree over the heads) and the sum rounded to bf16 once: the index scores of
`ops.attention_quant.index_scores_qat`. The fp4 × fp4 products are exact and the fp32 dot of D_I
of them is exact unless the block scales differ by about 2^10, so the scores equal the twin's but
where that sum rounds; on one GPU the selection is a deterministic function of each row (CP = N
equals CP = 1 bit for bit).
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4cp.kernels._triton import to_dtype


@triton.jit
def head_term(s, w, QAT: tl.constexpr, RNE: tl.constexpr):
    """One head's relu(s)·w in fp32, or the reference's bf16 steps under qat:
    bf16(relu(bf16(s)) · bf16(w)) (`ops.attention_quant.index_scores_qat`)."""
    if QAT:
        sb = to_dtype(s, tl.bfloat16, RNE).to(tl.float32)
        wb = to_dtype(w, tl.bfloat16, RNE).to(tl.float32)
        return to_dtype(tl.maximum(sb, 0.0) * wb, tl.bfloat16, RNE).to(tl.float32)
    else:
        return tl.maximum(s, 0.0) * w


@triton.jit
def index_score(acc, QAT: tl.constexpr, RNE: tl.constexpr):
    """The head sum as the index score: one bf16 rounding under qat."""
    if QAT:
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
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    STAGES: tl.constexpr,
):
    """acc + Σ_h head_term(q_h · kt, w_h), heads in order 0…H−1: q_ptrs [rows, D] and w_ptrs
    [rows] point at head 0 (next head: + stride_qh and + 1), kt [D, cols] the key tile, rows
    outside row_mask read zeros; one tensor-core product per head. STAGES: the loop's
    software-pipelining depth (None: the compiler's default)."""
    for _ in tl.range(0, H, num_stages=STAGES):
        qh = tl.load(q_ptrs, mask=row_mask[:, None], other=0.0)
        wh = tl.load(w_ptrs, mask=row_mask, other=0.0)
        if UPCAST:
            qh = qh.to(tl.float32)
        s = tl.dot(qh, kt, input_precision=DOT_PREC)
        acc += head_term(s, wh[:, None], QAT, RNE)
        q_ptrs += stride_qh
        w_ptrs += 1
    return acc
