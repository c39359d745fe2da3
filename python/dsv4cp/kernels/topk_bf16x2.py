"""The k-th largest of a piece of bf16-valued logits, two keys per 32-bit word (`kernels/topk.py`'s
search for `key_bits=16`).

The piece is held as packed bf16 pairs (the high halves of the fp32 logits: qat's index scores
are bf16 values), and each counting step is one `set.ge.u32.bf16x2` per pair — a 0xFFFF mask in
each half where the key is ≥ the candidate — summed as int32 words: the sum is L·0xFFFF +
H·0xFFFF0000 mod 2³² for L and H true halves, from which L + H is recovered (`_halves`), so a
step costs a compare and an add per two keys where the int32 keys cost a compare, a select and
an add per key. 16 steps walk the 16-bit order-preserving image u of the k-th value; a candidate
u is compared as the bf16 value it images, so the compare is the float order, in which −0 equals
+0 (the keys' canonical order: `topk_common.load_keys` maps −0 to +0, as the twin does). The
images below −inf's (the negative NaN patterns) are compared as −inf and those above +inf's count
nothing, which is what the keys' order gives while no key is a NaN. A piece holding a NaN
reports it (`ok` false) and the caller searches its int32 keys from memory instead. The search
also counts the keys ≥ τ: where exactly K are, the caller writes them with one prefix sum.

The CPU interpreter has no inline asm: EMULATE compares the unpacked halves as fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _ge_bf16x2(words, cand2, GT: tl.constexpr, EMULATE: tl.constexpr):
    """Per bf16 half of `words`: 0xFFFF where it is ≥ (GT: >) the bf16 in each half of cand2."""
    if EMULATE:
        c = (cand2 << 16).to(tl.float32, bitcast=True)
        lo = (words << 16).to(tl.float32, bitcast=True)
        hi = (words & -65536).to(tl.float32, bitcast=True)
        if GT:
            m_lo, m_hi = lo > c, hi > c
        else:
            m_lo, m_hi = lo >= c, hi >= c
        return tl.where(m_lo, 0xFFFF, 0) | tl.where(m_hi, -65536, 0)
    else:
        return tl.inline_asm_elementwise(
            asm="set.gt.u32.bf16x2 $0, $1, $2;" if GT else "set.ge.u32.bf16x2 $0, $1, $2;",
            constraints="=r,r,r",
            args=[words, cand2 + tl.zeros_like(words)],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )


@triton.jit
def _halves(masks):
    """How many 0xFFFF halves `masks` holds (fewer than 2¹⁵ a side): from their int32 sum
    s = L·0xFFFF + H·0xFFFF0000, L = −s mod 2¹⁶ and L − H = (s + L) >> 16."""
    s = tl.sum(masks, 0)
    lo = (0 - s) & 0xFFFF
    return 2 * lo - ((s + lo) >> 16)


@triton.jit
def _bf16_bits(u):
    """The bf16 bit pattern whose order-preserving 16-bit image is u (u ≥ −inf's image 0x7F)."""
    u = tl.maximum(u, 0x7F)
    return tl.where(u >= 0x8000, u & 0x7FFF, 0xFFFF - u)


@triton.jit
def kth_bf16x2(row_ptr, start, end, K: tl.constexpr, BLOCK: tl.constexpr, EMULATE: tl.constexpr):
    """Of the keys [start, end) of the row (bf16, or bf16-valued fp32; end − start in
    (K, BLOCK]): the K-th largest value τ (fp32; never −0), how many keys are > τ and how many
    ≥ τ, and ok — false when one of them is a NaN (τ and the counts are then meaningless)."""
    HALF: tl.constexpr = BLOCK // 2
    c_lo = start + tl.arange(0, HALF)
    c_hi = c_lo + HALF
    b_lo = tl.load(row_ptr + c_lo, mask=c_lo < end, other=float("nan")).to(tl.float32)
    b_hi = tl.load(row_ptr + c_hi, mask=c_hi < end, other=float("nan")).to(tl.float32)
    nans = ((b_lo != b_lo) & (c_lo < end)).to(tl.int32) + ((b_hi != b_hi) & (c_hi < end)).to(
        tl.int32
    )
    ok = tl.sum(nans, 0) == 0  # counted before the search, so no mask stays live through it
    # the pads are NaNs: no step counts them
    w_lo = (b_lo.to(tl.int32, bitcast=True) >> 16) & 0xFFFF
    words = w_lo | (b_hi.to(tl.int32, bitcast=True) & -65536)
    tau_u = tl.zeros([], dtype=tl.int32)
    n_ge = end - start  # the keys ≥ τ (all, while τ is −inf's image; no NaN counted)
    for i in range(16):
        cand_u = tau_u + (1 << (15 - i))
        b = _bf16_bits(cand_u)
        cnt = _halves(_ge_bf16x2(words, b | (b << 16), False, EMULATE))
        tau_u = tl.where(cnt >= K, cand_u, tau_u)
        n_ge = tl.where(cnt >= K, cnt, n_ge)
    b = _bf16_bits(tau_u)
    n_gt = _halves(_ge_bf16x2(words, b | (b << 16), True, EMULATE))
    return (b << 16).to(tl.float32, bitcast=True), n_gt, n_ge, ok
