"""Sparse MQA attention with a per-head sink logit (attention-math §4.6, §5.4).

One program per (query, block of up to 64 heads): every head of a query reads the same key set,
so each gathered kv row (K = V) is loaded once and serves BLOCK_H heads, first as K in
s = q·kᵀ, then as V in o += p·v. fp32 online softmax in base 2; the running max starts at the
sink logit and the running sum at e^0 = 1, so the sink takes its share of probability mass with
no value vector. -1 indices are masked; a row with no valid key gives 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv4cp.kernels._triton import interpreting, to_dtype

MAX_D = 512
# (BLOCK_N, num_warps, num_stages): the H200 default, picked by benchmarks/kernels.py --sweep.
DEFAULT_CONFIG = (64, 8, 2)
_LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): kernels read it, the host uses .value


@triton.jit
def _sparse_attention_kernel(
    q_ptr,
    kv_ptr,
    idx_ptr,
    sink_ptr,
    out_ptr,
    H,
    N,
    NUM_IDX,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kvn,
    stride_it,
    stride_ot,
    stride_oh,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
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
    m = sink
    l_sum = tl.where(sink > float("-inf"), 1.0, 0.0)
    acc = tl.zeros([BLOCK_H, D_PAD], dtype=tl.float32)
    idx_row = idx_ptr + t * stride_it
    for start in range(0, NUM_IDX, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_row + offs, mask=offs < NUM_IDX, other=-1)
        valid = (idx >= 0) & (idx < N)
        kv = tl.load(
            kv_ptr + idx[:, None].to(tl.int64) * stride_kvn + d[None, :],
            mask=valid[:, None] & d_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            kv = kv.to(tl.float32)
        s = tl.dot(q, tl.trans(kv), input_precision=DOT_PREC) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(kv.dtype), kv, acc, input_precision=DOT_PREC)
        m = m_new
    o = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
    tl.store(
        out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :],
        to_dtype(o, out_ptr.dtype.element_ty, UPCAST),
        mask=h_ok[:, None] & d_ok[None, :],
    )


def check_sparse_attention(q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor) -> None:
    """Raise ValueError naming the limit when the kernel cannot take these shapes."""
    if q.dim() != 3:
        raise ValueError(f"sparse_attention: q must be [T, H, D], got {tuple(q.shape)}")
    t, h, d = q.shape
    if d > MAX_D or d < 16:
        raise ValueError(f"sparse_attention kernel: D must be in [16, {MAX_D}], got {d}")
    if kv.dim() != 2 or kv.shape[1] != d:
        raise ValueError(f"sparse_attention: kv must be [N, {d}], got {tuple(kv.shape)}")
    if indices.dim() != 2 or indices.shape[0] != t:
        raise ValueError(f"sparse_attention: indices must be [{t}, K], got {tuple(indices.shape)}")
    if sink.shape != (h,):
        raise ValueError(f"sparse_attention: sink must be [{h}], got {tuple(sink.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or kv.dtype != q.dtype:
        raise ValueError(
            f"sparse_attention kernel: q and kv must share bf16/fp16/fp32, got {q.dtype}, "
            f"{kv.dtype}"
        )


def sparse_attention(q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float) -> Tensor:
    """Triton twin of ops.attention.sparse_attention: [T, H, D] in q.dtype."""
    return launch_sparse_attention(q, kv, indices, sink, scale)


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
    t, h, d = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if t == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    if kv.stride(1) != 1:
        kv = kv.contiguous()
    if indices.dtype != torch.int32:
        indices = indices.to(torch.int32)
    if indices.stride(1) != 1:
        indices = indices.contiguous()
    block_n, warps, stages = config or DEFAULT_CONFIG
    block_h = min(64, max(16, triton.next_power_of_2(h)))
    grid = (t, triton.cdiv(h, block_h))
    _sparse_attention_kernel[grid](
        q,
        kv,
        indices,
        sink.float().contiguous(),
        out,
        h,
        kv.shape[0],
        indices.shape[1],
        float(scale) * _LOG2E.value,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        indices.stride(0),
        out.stride(0),
        out.stride(1),
        D=d,
        D_PAD=max(16, triton.next_power_of_2(d)),
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        # The CPU interpreter computes bf16 tl.dot wrongly (numpy has no bf16): upcast there.
        UPCAST=interpreting() and q.dtype != torch.float32,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=warps,
        num_stages=stages,
    )
    return out


def attention_flops(t: int, h: int, k: int, d_qk: int = 512, d_v: int = 512) -> float:
    """2·T·H·K·(D_qk + D_v): the FlashMLA convention, counting every index slot."""
    return 2.0 * t * h * k * (d_qk + d_v)
