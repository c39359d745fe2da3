"""qat index logits on int8 tensor cores: the logits route's `mqa_logits` at twice the bf16 rate.

qat's index q and k are fake-fp4 values with power-of-two block scales
(`ops.attention_quant.fake_quant_index_fp4`), so each D-vector is n · 2^E with integers |n| ≤ 127
wherever its amax sets E = ⌊log2 amax⌋ − 6 and no smaller value falls between those steps
(`encode_int8`: a block scale at most 2^3 below the vector's largest, for fp4's two significant
bits). Then a head's dot is 2^(Eq+Ek) · S with S = Σ nq·nk an exact int32 (|S| ≤ 128·127² <
2^21, exact in fp32), and every step of the qat score commutes with the powers of two while
the numbers stay normal: bf16(relu(bf16(s))·bf16(w)) = 2^Ek · bf16(relu(bf16(S))·w′) with
w′ = bf16(w)·2^Eq (exact), the fp32 head sum and its bf16 rounding scale by 2^Ek as well. So
the kernel forms the same bits as `indexer_logits`'s qat kernel from int8 MMAs: S to fp32
(`convert`: "cvt", the default, is `cvt.rn.f32.s32`, which ptxas lowers to one I2FP.F32.S32 a
logit; "magic" adds S to 1.5·2^23's bits and subtracts 1.5·2^23 — ptxas starts the MMA's
accumulator at that constant, so one move and one FADD a logit), the packed qat steps on w′
(`relu_fma`, the default: bf16(relu(x)·w′) = sign(w′)·relu(bf16(x·|w′|)) for these finite
values, so one `fma.rn.relu.bf16x2` a pair does the relu and the product and the sign rides on
the head sum's FFMA), and one multiply by 2^Ek per column at the end. With both, ptxas's head
step is 357 SASS instructions for 64 logits a thread against 447 (magic, max and mul), and the
kernel at 2 stages under a 168-register cap (3 programs an SM, ~100 B spilled) ran 1.27× /
1.34× the bf16 kernel at cold 16K / 64K against 1.11× / 1.15× for the first int8 form
(docs/performance.md §41, H100).

`encode_int8` marks a vector usable (`ok`) only where the identity is exact: E in [−30, 30]
and, for a query row, every nonzero head weight in [2^−30, 2^30] (then no true step is
subnormal or overflows). A row block × key tile with any vector not usable is formed by the
bf16 kernel's steps from the bf16 operands in the same launch (the per-tile branch), so the
result is `indexer_logits.launch_mqa_logits(quant="qat")`'s for every input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv4cp.kernels._triton import interpreting, to_dtype
from dsv4cp.kernels.index_score import add_heads, head_term, index_score
from dsv4cp.kernels.indexer_logits import (
    check_mqa_logits,
    launch_mixed_rows,
    logits_launch_args,
    store_tile,
    tile_rows,
)
from dsv4cp.ops.quant import QuantMode, check_quant_mode

E_LIMIT = 30  # |E| and |log2 w| bound for the exact identity (module docstring)
DEFAULT_CONFIG = (64, 128, 4, 2)  # (BLOCK_T, BLOCK_N, num_warps, num_stages)
DEFAULT_MAXNREG = 168  # ptxas's cap at DEFAULT_CONFIG: 3 programs an SM (docs/performance.md §41)


@triton.jit
def _encode_kernel(
    x_ptr, w_ptr, codes_ptr, scale_ptr, w2_ptr, ok_ptr, V, G, E_LIM: tl.constexpr,
    D: tl.constexpr, G_PAD: tl.constexpr, HAS_W: tl.constexpr, EMULATE: tl.constexpr,
):  # fmt: skip
    # One program: one group of G vectors (a query row's heads, or one key): codes, 2^E, ok.
    v = tl.program_id(0)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    g_ok = g < G
    base = v.to(tl.int64) * G * D
    x = tl.load(x_ptr + base + g[:, None] * D + d[None, :], mask=g_ok[:, None], other=0.0)
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    biased = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # inf/NaN: 255, zero: 0
    e = tl.where(amax > 0, biased - 127 - 6, 0)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-E, normal for |E| ≤ E_LIM
    n = x * inv[:, None]
    finite = tl.sum((x != x).to(tl.int32), 1) == 0  # max and abs let NaN through
    good = (tl.abs(e) <= E_LIM) & finite & (biased < 255)
    good = good & (tl.max(tl.abs(n - n.to(tl.int32).to(tl.float32)), 1) == 0)
    scale = ((127 + e) << 23).to(tl.float32, bitcast=True)
    codes = tl.where(good[:, None], n, 0.0).to(tl.int8)
    tl.store(codes_ptr + base + g[:, None] * D + d[None, :], codes, mask=g_ok[:, None])
    if HAS_W:
        wb = tl.load(w_ptr + v.to(tl.int64) * G + g, mask=g_ok, other=0.0)
        wb = to_dtype(wb, tl.bfloat16, EMULATE).to(tl.float32)
        wm = tl.abs(wb)
        w_good = (wm == 0) | ((wm >= 2.0**-E_LIM) & (wm <= 2.0**E_LIM))
        good = good & w_good
        tl.store(w2_ptr + v.to(tl.int64) * G + g, wb * scale, mask=g_ok)
    else:
        tl.store(scale_ptr + v.to(tl.int64) * G + g, scale, mask=g_ok)
    all_good = tl.min(tl.where(g_ok, good, 1).to(tl.int32), 0)
    tl.store(ok_ptr + v, all_good.to(tl.int8))


def encode_int8(x: Tensor, weights: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """x [V, G, D] (query rows × heads) or [V, D] (keys), fake-fp4-valued: (int8 codes like x;
    for a query the weights bf16(w)·2^Eq [V, G] fp32 (`weights` [V, G], rounded to bf16 here),
    for keys 2^Ek [V] fp32; ok [V] int8: 1 where every vector of the group is n · 2^E exactly
    and, for a query, its head weights are in range)."""
    grouped = x.dim() == 3
    v, g, d = x.shape if grouped else (x.shape[0], 1, x.shape[1])
    x = x.contiguous()
    codes = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    ok = torch.empty((v,), dtype=torch.int8, device=x.device)
    side = torch.empty((v, g) if weights is not None else (v,), dtype=torch.float32,
                       device=x.device)  # fmt: skip
    if v:
        w = side if weights is None else weights.float().contiguous()
        _encode_kernel[(v,)](
            x, w, codes, side, side, ok, v, g, E_LIM=E_LIMIT, D=d,
            G_PAD=max(2, triton.next_power_of_2(g)), HAS_W=weights is not None,
            EMULATE=interpreting(),
        )  # fmt: skip
    return codes, side, ok


CONVERTS = ("magic", "cvt")


@triton.jit
def _as_fp32(s, CVT: tl.constexpr):
    """An int32 |s| < 2^22 as fp32, exactly: 1.5·2^23's bits plus s, less 1.5·2^23; CVT: the
    conversion instruction."""
    if CVT:
        return s.to(tl.float32)
    else:
        return (s + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _relu_term_bf16x2(s, w_abs):
    """bf16(relu(bf16(s)) · w_abs) as fp32 for w_abs ≥ 0 and a finite product, two values per
    asm block: the product rounded once with the relu on it (`fma.rn.relu.bf16x2`, +0 added),
    equal to relu first and `mul.rn` after because w_abs ≥ 0 and RN is symmetric."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 p, z;
        mov.b32 z, 0;
        cvt.rn.bf16x2.f32 p, $3, $2;
        fma.rn.relu.bf16x2 p, p, $4, z;
        shl.b32 $0, p, 16;
        and.b32 $1, p, 0xFFFF0000;
        }""",
        constraints="=r,=r,r,r,r",
        args=[s, w_abs],
        dtype=tl.float32,
        is_pure=True,
        pack=2,
    )


@triton.jit
def _exact_term(s, wh, EMULATE: tl.constexpr, PACKED: tl.constexpr, RELU_FMA: tl.constexpr):
    """One head's qat term of the exact path from its fp32 sums s [rows, cols] and the row's
    scaled weights wh [rows]: head_term's bits. RELU_FMA (GPU): the weight's sign is taken out
    (bf16(relu(x)·w) = ±bf16(relu(x·|w|)), exact for the finite values this path holds) so
    the relu rides on the product's rounding and the sign on the head sum's add (an FFMA)."""
    if RELU_FMA and PACKED and not EMULATE:
        sign = tl.where(wh < 0, -1.0, 1.0)
        return _relu_term_bf16x2(s, tl.abs(wh).to(tl.bfloat16)[:, None]) * sign[:, None]
    else:
        return head_term(s, wh[:, None], True, EMULATE, PACKED)


@triton.jit
def int8_heads(
    acc, q8_ptrs, w2_ptrs, k8, row_mask, H, stride_qh, EMULATE: tl.constexpr,
    PACKED: tl.constexpr, CVT: tl.constexpr, RELU_FMA: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """The exact path's head loop (`add_heads`' int8 twin): acc + Σ_h the qat term of head h in
    2^-Ek units, heads in order 0…H−1: q8_ptrs [rows, D] and w2_ptrs [rows] point at head 0's
    codes and scaled weights (`encode_int8`; next head: + stride_qh and + 1), k8 [D, cols] the
    key tile's codes, rows outside row_mask read zeros; one int8 tensor-core product per head.
    The caller multiplies `index_score(acc)` by the keys' 2^Ek."""
    for _ in tl.range(0, H, num_stages=STAGES):
        q8 = tl.load(q8_ptrs, mask=row_mask[:, None], other=0)
        wh = tl.load(w2_ptrs, mask=row_mask, other=0.0)
        s = tl.dot(q8, k8, out_dtype=tl.int32)
        acc += _exact_term(_as_fp32(s, CVT), wh, EMULATE, PACKED, RELU_FMA)
        q8_ptrs += stride_qh
        w2_ptrs += 1
    return acc


@triton.jit
def _mqa_logits_int8_kernel(
    q8_ptr, w2_ptr, qok_ptr, k8_ptr, kscale_ptr, kok_ptr, q_ptr, w_ptr, k_ptr, nvis_ptr,
    kstart_ptr, out_ptr, T, H, N, WIDTH, stride_qt, stride_qh, stride_wt, stride_kn,
    stride_ot, HAS_KSTART: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr, STAGES: tl.constexpr, EMULATE: tl.constexpr, PACKED: tl.constexpr,
    FILL: tl.constexpr, CVT: tl.constexpr, RELU_FMA: tl.constexpr,
):  # fmt: skip
    # Row blocks that share one k_start (all of them without k_start), as indexer_logits's
    # tile kernel; the others are left to its per-row kernel.
    rows, row_ok, cols, nvis, max_vis, ks_lo, uniform = tile_rows(
        nvis_ptr, kstart_ptr, T, WIDTH, HAS_KSTART, BLOCK_T, BLOCK_N
    )
    d = tl.arange(0, D)
    key_rows = ks_lo + cols
    key_ok = (cols < max_vis) & (key_rows < N)
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    col_scale = tl.full([BLOCK_N], 1.0, tl.float32)
    if uniform & (tl.program_id(0) * BLOCK_N < max_vis):
        q_exact = tl.min(tl.load(qok_ptr + rows, mask=row_ok, other=1).to(tl.int32), 0)
        k_exact = tl.min(tl.load(kok_ptr + key_rows, mask=key_ok, other=1).to(tl.int32), 0)
        k_off = key_rows[None, :].to(tl.int64) * stride_kn + d[:, None]
        q_off = rows[:, None].to(tl.int64) * stride_qt + d[None, :]
        w_off = rows.to(tl.int64) * stride_wt
        if (q_exact == 1) & (k_exact == 1):
            k8 = tl.load(k8_ptr + k_off, mask=key_ok[None, :], other=0)
            col_scale = tl.load(kscale_ptr + key_rows, mask=key_ok, other=1.0)
            acc = int8_heads(acc, q8_ptr + q_off, w2_ptr + w_off, k8, row_ok, H, stride_qh,
                             EMULATE, PACKED, CVT, RELU_FMA, STAGES)  # fmt: skip
        else:  # the bf16 kernel's steps (indexer_logits, qat)
            kt = tl.load(k_ptr + k_off, mask=key_ok[None, :], other=0.0)
            if EMULATE:
                kt = kt.to(tl.float32)
            acc = add_heads(acc, q_ptr + q_off, w_ptr + w_off, kt, row_ok, H, stride_qh, True,
                            EMULATE, PACKED, EMULATE, "tf32", STAGES)  # fmt: skip
    if uniform:
        acc = index_score(acc, True, EMULATE, PACKED) * col_scale[None, :]
        store_tile(out_ptr, acc, rows, row_ok, cols, nvis, stride_ot, WIDTH, FILL)


def launch_mqa_logits_int8(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    n_visible: Tensor,
    *,
    k_start: Tensor | None = None,
    width: int | None = None,
    quant: QuantMode = "qat",
    k_encoded: tuple[Tensor, Tensor, Tensor] | None = None,
    config: tuple[int, int, int, int] | None = None,
    packed: bool = True,
    fill: bool = True,
    convert: str = "cvt",
    maxnreg: int | None = DEFAULT_MAXNREG,
    relu_fma: bool = True,
) -> Tensor:
    """`indexer_logits.launch_mqa_logits(quant="qat")` on int8 MMAs: the same fp32
    [T, width]. `k_encoded`: encode_int8(k), made once for several row chunks of the same k
    (the route's), else made here; q's is made here. Row blocks that do not share one
    k_start go to indexer_logits's per-row kernel (bf16). `fill` as launch_mqa_logits;
    `convert`: how the int32 sums become fp32 (module docstring; the same values); `maxnreg`:
    ptxas's register cap for the tile kernel (None: none; DEFAULT_MAXNREG lets 3 programs
    share an SM at DEFAULT_CONFIG); `relu_fma`: the exact path's relu and weight product in
    one `fma.rn.relu.bf16x2` a pair, the weight's sign on the head sum's add (the same values;
    `_exact_term`); False: `max` then `mul`, as the bf16 kernel."""
    check_mqa_logits(q, weights, k, n_visible)
    if convert not in CONVERTS:
        raise ValueError(f"mqa_logits int8: convert must be one of {CONVERTS}, got {convert!r}")
    if check_quant_mode(quant) != "qat":
        raise ValueError(f"mqa_logits int8: qat only (fake-fp4 q and k), got quant={quant!r}")
    if q.dtype != torch.bfloat16:
        raise ValueError(f"mqa_logits int8: q and k must be bf16 (fake-fp4 values), got {q.dtype}")
    q, k = q.contiguous(), k.contiguous()  # the codes' strides are q's and k's
    out, args = logits_launch_args(q, weights, k, n_visible, k_start, width, True)
    if not out.numel():
        return out
    encoded = (*encode_int8(q, weights), *(k_encoded or encode_int8(k)))
    block_t, block_n, warps, stages = config or DEFAULT_CONFIG
    grid = (triton.cdiv(out.shape[1], block_n), triton.cdiv(out.shape[0], block_t))
    _mqa_logits_int8_kernel[grid](
        *encoded, *args, HAS_KSTART=k_start is not None, D=q.shape[2], BLOCK_T=block_t,
        BLOCK_N=block_n, STAGES=stages, EMULATE=interpreting(), PACKED=packed and q.is_cuda,
        FILL=fill, CVT=convert == "cvt", RELU_FMA=relu_fma, num_warps=warps, num_stages=stages,
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip
    if k_start is not None:
        launch_mixed_rows(args, grid, block_t, block_n, True)
    return out


# The scan's int8 head loop (`indexer_topk_scan.scan_kernel`, INT8): the logits kernel's default
# form (cvt + relu_fma, docs/performance.md §41); the other forms are the same values.
SCAN_CONVERT = "cvt"
SCAN_RELU_FMA = True


def scan_int8_args(
    q: Tensor, weights: Tensor, k_encoded: tuple[Tensor, Tensor, Tensor] | None, stub: Tensor
) -> tuple[tuple[Tensor, ...], dict[str, bool]]:
    """scan_kernel's int8 operands for one launch's query rows — (q8, w2, qok) of
    encode_int8(q, weights), then `k_encoded` = encode_int8(k), made once for every launch of
    the keys — and its INT8, CVT, RELU_FMA flags; with k_encoded None the scan stays on bf16
    MMAs (`stub` for every operand, INT8 off)."""
    flags = {"INT8": k_encoded is not None, "CVT": SCAN_CONVERT == "cvt",
             "RELU_FMA": SCAN_RELU_FMA}  # fmt: skip
    if k_encoded is None:
        return (stub,) * 6, flags
    return (*encode_int8(q, weights), *k_encoded), flags
