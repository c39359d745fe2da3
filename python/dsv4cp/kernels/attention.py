"""Sparse MQA attention with a per-head sink logit (attention-math §4.6, §5.4), reading the
layer's caches in their storage formats.

One program per (query, block of up to 64 heads): every head of a query reads the same key set,
so each gathered kv row (K = V) is loaded once and serves BLOCK_H heads, first as K in
s = q·kᵀ, then as V in o += p·v. fp32 online softmax in base 2; the running max starts at the
sink logit and the running sum at e^0 = 1, so the sink takes its share of probability mass with
no value vector. -1 indices are masked; a row with no valid key gives 0.

Two key sources are read one after the other (the SWA rows, then the compressed rows), each in
its format (`ops.kv_format`): dense rows are loaded as stored; fp8 / fp4 rows are decoded on load
from their code and scale bytes to exact fp32 values, which are also exact in bf16, so a bf16
query multiplies the same tensor-core inputs as with a dense cache of the dequantized values.
No workspace is built: the caches are read in place.

quant="qat" follows the reference's `sparse_attn` order (ops.attention_quant.sparse_attention_qat):
blocks of 64 indices over the one concatenated list (SWA indices, then compressed: a block may
straddle the two sources, as it does when the window is not a multiple of 64), the running max
starting at −1e30 without the sink, the probabilities rounded to bf16 for p·v (the running sum
keeps fp32 p), the sink's term added at the end. The kernel works in base 2 (exp2 of
log2(e)-scaled scores), so it agrees with the torch order to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from dsv4cp.kernels._triton import dot_flags, to_dtype
from dsv4cp.kernels.kv_decode import FORMAT_CODES, load_key_rows
from dsv4cp.ops.kv_format import check_format, row_width
from dsv4cp.ops.quant import QuantMode, check_quant_mode

MAX_D = 512
# (BLOCK_N, num_warps, num_stages): the H200 default, picked by benchmarks/kernels.py --sweep.
DEFAULT_CONFIG = (64, 8, 2)
QAT_BLOCK_N = 64  # the reference's sparse_attn block (ops.attention_quant.ATTENTION_BLOCK)
_LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): kernels read it, the host uses .value


@triton.jit
def _online_update(
    q, m, l_sum, acc, kv, valid, qk_scale, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    QAT: tl.constexpr, RNE: tl.constexpr,
):  # fmt: skip
    """One block of keys (K = V) into the fp32 online softmax; returns (m, l_sum, acc)."""
    if UPCAST:
        kv = kv.to(tl.float32)
    else:
        kv = kv.to(q.dtype)  # decoded values are exact in bf16 / fp16
    s = tl.dot(q, tl.trans(kv), input_precision=DOT_PREC) * qk_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_sum = l_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if QAT:  # the reference rounds p to bf16 for p·v (interpreter: emulate the RNE cast)
        p = to_dtype(p, tl.bfloat16, RNE)
    acc = tl.dot(p.to(kv.dtype), kv, acc, input_precision=DOT_PREC)
    return m_new, l_sum, acc


@triton.jit
def _attend_source(
    q,
    m,
    l_sum,
    acc,
    kv_ptr,
    idx_row,
    N,
    NUM_IDX,
    stride_kvn,
    qk_scale,
    d,
    d_ok,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FMT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    QAT: tl.constexpr,
    RNE: tl.constexpr,
):
    """The online-softmax update over one source's indices; returns (m, l_sum, acc). In qat
    its blocks are the reference's only when the list is the whole one (`ONE_LIST`)."""
    for start in range(0, NUM_IDX, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_row + offs, mask=offs < NUM_IDX, other=-1)
        valid = (idx >= 0) & (idx < N)
        rows = kv_ptr + idx[:, None].to(tl.int64) * stride_kvn
        kv = load_key_rows(rows, d, valid[:, None] & d_ok[None, :], D, FMT)
        m, l_sum, acc = _online_update(
            q, m, l_sum, acc, kv, valid, qk_scale, UPCAST, DOT_PREC, QAT, RNE
        )
    return m, l_sum, acc


@triton.jit
def _attend_concatenated(
    q, m, l_sum, acc,
    swa_ptr, swa_idx_row, N_SWA, NUM_SWA_IDX, stride_swa,
    comp_ptr, comp_idx_row, N_COMP, NUM_COMP_IDX, stride_comp,
    qk_scale, d, d_ok, D: tl.constexpr, BLOCK_N: tl.constexpr, SWA_FMT: tl.constexpr,
    COMP_FMT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, RNE: tl.constexpr,
):  # fmt: skip
    """qat: blocks of BLOCK_N over the concatenated index list (SWA indices, then compressed), as
    the reference's `sparse_attn` walks its one list: a block may hold keys of both sources, and
    each block's max sets the bf16 rounding of its p."""
    for start in range(0, NUM_SWA_IDX + NUM_COMP_IDX, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        in_swa = offs < NUM_SWA_IDX
        c_offs = offs - NUM_SWA_IDX
        in_comp = (c_offs >= 0) & (c_offs < NUM_COMP_IDX)
        si = tl.load(swa_idx_row + offs, mask=in_swa, other=-1)
        ci = tl.load(comp_idx_row + c_offs, mask=in_comp, other=-1)
        s_ok = in_swa & (si >= 0) & (si < N_SWA)
        c_ok = in_comp & (ci >= 0) & (ci < N_COMP)
        ks = load_key_rows(
            swa_ptr + si[:, None].to(tl.int64) * stride_swa, d, s_ok[:, None] & d_ok[None, :],
            D, SWA_FMT,
        )  # fmt: skip
        kc = load_key_rows(
            comp_ptr + ci[:, None].to(tl.int64) * stride_comp, d, c_ok[:, None] & d_ok[None, :],
            D, COMP_FMT,
        )  # fmt: skip
        kv = tl.where(s_ok[:, None], ks.to(tl.float32), kc.to(tl.float32))
        m, l_sum, acc = _online_update(
            q, m, l_sum, acc, kv, s_ok | c_ok, qk_scale, UPCAST, DOT_PREC, True, RNE
        )
    return m, l_sum, acc


# Triton's JIT compiles an int argument equal to 1 as a constant: an index count of 1 made the
# one-trip loop pipeline into 262 KB of shared memory at Flash dims, above Hopper's 227 KB (the
# H100 refused it). The launcher never passes an index count of 1 where it would be such a loop's
# (`no_count_of_one`), so the counts keep Triton's divisible-by-16 specialisation, which the cached
# kernel's speed needs (docs/performance.md §25); the row counts only bound a mask and stay
# runtime values (tests/kernels/test_attention_compile.py).
@triton.jit(do_not_specialize=["N_SWA", "N_COMP"])
def _sparse_attention_kernel(
    q_ptr,
    swa_ptr,
    swa_idx_ptr,
    comp_ptr,
    comp_idx_ptr,
    sink_ptr,
    out_ptr,
    H,
    N_SWA,
    N_COMP,
    NUM_SWA_IDX,
    NUM_COMP_IDX,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_swa,
    stride_swa_it,
    stride_comp,
    stride_comp_it,
    stride_ot,
    stride_oh,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SWA_FMT: tl.constexpr,
    COMP_FMT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    QAT: tl.constexpr,
    ONE_LIST: tl.constexpr,
    RNE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    q = tl.load(
        q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=h_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    sink = tl.load(sink_ptr + heads, mask=h_ok, other=float("-inf")).to(tl.float32)
    sink = sink * _LOG2E
    if QAT:  # the running max starts at -1e30 and never takes the sink
        m = tl.full([BLOCK_H], -1e30, dtype=tl.float32)
        l_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    else:
        m = sink
        l_sum = tl.where(sink > float("-inf"), 1.0, 0.0)
    acc = tl.zeros([BLOCK_H, D_PAD], dtype=tl.float32)
    if QAT and not ONE_LIST:  # the reference's blocks run over [SWA | compressed]
        m, l_sum, acc = _attend_concatenated(
            q, m, l_sum, acc,
            swa_ptr, swa_idx_ptr + t * stride_swa_it, N_SWA, NUM_SWA_IDX, stride_swa,
            comp_ptr, comp_idx_ptr + t * stride_comp_it, N_COMP, NUM_COMP_IDX, stride_comp,
            qk_scale, d, d_ok, D, BLOCK_N, SWA_FMT, COMP_FMT, UPCAST, DOT_PREC, RNE,
        )  # fmt: skip
    else:  # qat here only with ONE_LIST: the SWA list is the reference's whole list
        m, l_sum, acc = _attend_source(
            q, m, l_sum, acc, swa_ptr, swa_idx_ptr + t * stride_swa_it, N_SWA, NUM_SWA_IDX,
            stride_swa, qk_scale, d, d_ok, D, BLOCK_N, SWA_FMT, UPCAST, DOT_PREC, QAT, RNE,
        )  # fmt: skip
        if not QAT:
            m, l_sum, acc = _attend_source(
                q, m, l_sum, acc, comp_ptr, comp_idx_ptr + t * stride_comp_it, N_COMP,
                NUM_COMP_IDX, stride_comp, qk_scale, d, d_ok, D, BLOCK_N, COMP_FMT, UPCAST,
                DOT_PREC, False, RNE,
            )  # fmt: skip
    if QAT:  # the sink's term joins the sum at the end, outside the running max
        l_sum = l_sum + tl.exp2(sink - m)
    o = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
    tl.store(
        out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :],
        to_dtype(o, out_ptr.dtype.element_ty, UPCAST),
        mask=h_ok[:, None] & d_ok[None, :],
    )


def _check_source(
    cache: Tensor, indices: Tensor, fmt: str, q: Tensor, what: str, limit: str
) -> None:
    t, _, d = q.shape
    fmt = check_format(fmt)
    width = row_width(fmt, d)
    if cache.dim() != 2 or cache.shape[1] != width:
        raise ValueError(f"{limit}: {what} must be [N, {width}] ({fmt}), got {tuple(cache.shape)}")
    if indices.dim() != 2 or indices.shape[0] != t:
        raise ValueError(f"{limit}: {what} indices must be [{t}, K], got {tuple(indices.shape)}")
    want = q.dtype if fmt == "dense" else torch.uint8
    if cache.dtype != want:
        raise ValueError(f"{limit}: {what} ({fmt}) must be {want}, got {cache.dtype}")


def _check_query(q: Tensor, sink: Tensor, name: str) -> None:
    if q.dim() != 3:
        raise ValueError(f"{name}: q must be [T, H, D], got {tuple(q.shape)}")
    h, d = q.shape[1], q.shape[2]
    if d > MAX_D or d < 16:
        raise ValueError(f"{name} kernel: D must be in [16, {MAX_D}], got {d}")
    if sink.shape != (h,):
        raise ValueError(f"{name}: sink must be [{h}], got {tuple(sink.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name} kernel: q must be bf16/fp16/fp32, got {q.dtype}")


def check_sparse_attention(q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor) -> None:
    """Raise ValueError naming the limit when the kernel cannot take these shapes."""
    _check_query(q, sink, "sparse_attention")
    t, _, d = q.shape
    if kv.dim() != 2 or kv.shape[1] != d:
        raise ValueError(f"sparse_attention: kv must be [N, {d}], got {tuple(kv.shape)}")
    if indices.dim() != 2 or indices.shape[0] != t:
        raise ValueError(f"sparse_attention: indices must be [{t}, K], got {tuple(indices.shape)}")
    if kv.dtype != q.dtype:
        raise ValueError(
            f"sparse_attention kernel: q and kv must share bf16/fp16/fp32, got {q.dtype}, "
            f"{kv.dtype}"
        )


def check_sparse_attention_cached(
    q: Tensor,
    swa: Tensor,
    swa_indices: Tensor,
    comp: Tensor | None,
    comp_indices: Tensor | None,
    sink: Tensor,
    swa_format: str,
    comp_format: str,
) -> None:
    """Raise ValueError naming the limit when the kernel cannot take these caches."""
    name = "sparse_attention_cached"
    _check_query(q, sink, name)
    if q.shape[2] % 32:
        raise ValueError(f"{name} kernel: D must be a multiple of 32, got {q.shape[2]}")
    _check_source(swa, swa_indices, swa_format, q, "swa", name)
    if (comp is None) != (comp_indices is None):
        raise ValueError(f"{name}: comp and comp_indices come together")
    if comp is not None and comp_indices is not None:
        _check_source(comp, comp_indices, comp_format, q, "comp", name)


def sparse_attention(q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float) -> Tensor:
    """Triton twin of ops.attention.sparse_attention: [T, H, D] in q.dtype."""
    return launch_sparse_attention(q, kv, indices, sink, scale)


def sparse_attention_cached(
    q: Tensor,
    swa: Tensor,
    swa_indices: Tensor,
    comp: Tensor | None,
    comp_indices: Tensor | None,
    sink: Tensor,
    scale: float,
    swa_format: str = "dense",
    comp_format: str = "dense",
    quant: QuantMode = "none",
    *,
    workspace_rows: tuple[int, int] | None = None,
) -> Tensor:
    """Triton twin of ops.attention.sparse_attention_cached: [T, H, D] in q.dtype (reads the
    caches in place: `workspace_rows` is unused)."""
    check_sparse_attention_cached(
        q, swa, swa_indices, comp, comp_indices, sink, swa_format, comp_format
    )
    qat = check_quant_mode(quant) == "qat"
    return _launch(
        q,
        (swa, swa_indices, swa_format),
        (comp, comp_indices, comp_format),
        sink,
        scale,
        config=(QAT_BLOCK_N, *DEFAULT_CONFIG[1:]) if qat else None,
        qat=qat,
    )


def launch_sparse_attention(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    sink: Tensor,
    scale: float,
    *,
    config: tuple[int, int, int] | None = None,
) -> Tensor:
    """sparse_attention with an explicit (BLOCK_N, num_warps, num_stages) (benchmarks)."""
    check_sparse_attention(q, kv, indices, sink)
    return _launch(q, (kv, indices, "dense"), (None, None, "dense"), sink, scale, config=config)


Source = tuple[Tensor | None, Tensor | None, str]


def pipeline_stages(
    stages: int, swa_fmt: int, comp_fmt: int, qat: bool, one_list: bool = False
) -> int:
    """num_stages for a launch: qat over two dense sources pipelines bf16 K tiles of both and
    needs 257 KB of shared memory at D = 512, 64 heads, BLOCK_N 64 with 2 stages — above
    Hopper's 227 KB (Triton 3.6 sm_90 compile; the H200 refused the launch) — so it takes one
    stage. Every other combination, a single list (`one_list`) included, fits with 2
    (tests/kernels/test_attention_compile.py)."""
    dense = FORMAT_CODES["dense"]
    two_dense = swa_fmt == dense and comp_fmt == dense and not one_list
    return 1 if qat and two_dense else stages


def _prepared(src: Source, q: Tensor) -> tuple[Tensor, Tensor, int]:
    """(rows, int32 indices [T, K], format code); an absent source is one dense dummy row and
    K = 0."""
    cache, idx, fmt = src
    if cache is None or idx is None:
        empty = torch.zeros(q.shape[0], 1, dtype=torch.int32, device=q.device)[:, :0]
        return q.new_zeros(1, q.shape[2]), empty, 0
    if cache.stride(1) != 1:
        cache = cache.contiguous()
    if idx.dtype != torch.int32:
        idx = idx.to(torch.int32)
    if idx.stride(1) != 1:
        idx = idx.contiguous()
    return cache, idx, FORMAT_CODES[fmt]


def no_count_of_one(swa_idx: Tensor, comp_idx: Tensor, qat: bool) -> tuple[Tensor, Tensor]:
    """The index lists with a −1 column (a skipped key) appended to a list of one index that
    would be a loop's whole trip count (the kernel's comment): the compressed list, and the SWA
    list unless, in qat, a compressed list follows it — there the reference's 64-key blocks run
    over the concatenation, a column inserted between would move them, and the loop's trip count
    is the sum of both counts, a runtime value."""
    if comp_idx.shape[1] == 1:
        comp_idx = F.pad(comp_idx, (0, 1), value=-1)
    if swa_idx.shape[1] == 1 and not (qat and comp_idx.shape[1] > 0):
        swa_idx = F.pad(swa_idx, (0, 1), value=-1)
    return swa_idx, comp_idx


def _launch(
    q: Tensor,
    swa_src: Source,
    comp_src: Source,
    sink: Tensor,
    scale: float,
    *,
    config: tuple[int, int, int] | None = None,
    qat: bool = False,
) -> Tensor:
    t, h, d = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if t == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    swa, swa_idx, swa_fmt = _prepared(swa_src, q)
    comp, comp_idx, comp_fmt = _prepared(comp_src, q)
    swa_idx, comp_idx = no_count_of_one(swa_idx, comp_idx, qat)
    block_n, warps, stages = config or DEFAULT_CONFIG
    one_list = comp_src[0] is None or comp_src[1] is None
    stages = pipeline_stages(stages, swa_fmt, comp_fmt, qat, one_list)
    block_h = min(64, max(16, triton.next_power_of_2(h)))
    grid = (t, triton.cdiv(h, block_h))
    _sparse_attention_kernel[grid](
        q,
        swa,
        swa_idx,
        comp,
        comp_idx,
        sink.float().contiguous(),
        out,
        h,
        swa.shape[0] if swa_src[0] is not None else 0,
        comp.shape[0] if comp_src[0] is not None else 0,
        swa_idx.shape[1],
        comp_idx.shape[1],
        float(scale) * _LOG2E.value,
        q.stride(0),
        q.stride(1),
        swa.stride(0),
        max(swa_idx.stride(0), 1),
        comp.stride(0),
        max(comp_idx.stride(0), 1),
        out.stride(0),
        out.stride(1),
        D=d,
        D_PAD=max(16, triton.next_power_of_2(d)),
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        SWA_FMT=swa_fmt,
        COMP_FMT=comp_fmt,
        **dot_flags(q.dtype),
        QAT=qat,
        ONE_LIST=one_list,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def attention_flops(t: int, h: int, k: int, d_qk: int = 512, d_v: int = 512) -> float:
    """2·T·H·K·(D_qk + D_v): the FlashMLA convention, counting every index slot."""
    return 2.0 * t * h * k * (d_qk + d_v)
