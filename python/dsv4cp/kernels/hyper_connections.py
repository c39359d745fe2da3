"""mHC's collapse and expand as one pass each (Triton): twins of `ops.hyper_connections`.

The torch twins materialise fp32 copies of the streams and, for the expand, the [T, H, H, d]
products (5.4 GB at 16K tokens, H = 4, d = 5120); these kernels read each stream once and write
the result once. The arithmetic is the twin's, in its order: each product rounded in fp32, the
sum over the source stream i taken sequentially from 0 (torch's order for a reduction over that
dim, checked bit for bit on CPU), the post term added last, one rounding to the output dtype. FMA
contraction is switched off at launch so that a product is rounded before it is added.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv4cp.kernels._triton import TL_DTYPES, check_tl_dtype, interpreting, to_dtype
from dsv4cp.ops.hyper_connections import check_collapse_args, check_expand_args

BLOCK_D = 512


@triton.jit
def _hc_collapse_kernel(
    x_ptr,
    pre_ptr,
    out_ptr,
    D,
    stride_xt,
    stride_xh,
    stride_pt,
    stride_ot,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    OUT: tl.constexpr,
    EMULATE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < D
    acc = tl.zeros([BLOCK], tl.float32)
    for i in tl.static_range(H):
        p = tl.load(pre_ptr + t * stride_pt + i).to(tl.float32)
        xi = tl.load(x_ptr + t * stride_xt + i * stride_xh + cols, mask=ok, other=0.0)
        acc = acc + p * xi.to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols, to_dtype(acc, OUT, EMULATE), mask=ok)


@triton.jit
def _hc_expand_kernel(
    y_ptr,
    res_ptr,
    post_ptr,
    comb_ptr,
    out_ptr,
    D,
    stride_yt,
    stride_rt,
    stride_rh,
    stride_pt,
    stride_ct,
    stride_ci,
    stride_ot,
    stride_oh,
    H: tl.constexpr,
    H_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    OUT: tl.constexpr,
    EMULATE: tl.constexpr,
):
    # one program: one token, BLOCK columns, all H output streams j as the rows of a tile
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < D
    j = tl.arange(0, H_PAD)
    j_ok = j < H
    acc = tl.zeros([H_PAD, BLOCK], tl.float32)
    for i in tl.static_range(H):  # Σ_i comb[i, j] · residual[i], sequential in i
        c = tl.load(comb_ptr + t * stride_ct + i * stride_ci + j, mask=j_ok, other=0.0)
        r = tl.load(res_ptr + t * stride_rt + i * stride_rh + cols, mask=ok, other=0.0)
        acc = acc + c.to(tl.float32)[:, None] * r.to(tl.float32)[None, :]
    y = tl.load(y_ptr + t * stride_yt + cols, mask=ok, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * stride_pt + j, mask=j_ok, other=0.0).to(tl.float32)
    out = post[:, None] * y[None, :] + acc
    dst = out_ptr + t * stride_ot + j[:, None] * stride_oh + cols[None, :]
    tl.store(dst, to_dtype(out, OUT, EMULATE), mask=j_ok[:, None] & ok[None, :])


def _rows(x: Tensor) -> Tensor:
    check_tl_dtype(x, "hyper-connection kernels: the streams")
    return x if x.stride(-1) == 1 else x.contiguous()


def hc_collapse(x: Tensor, pre: Tensor) -> Tensor:
    """Kernel twin of `ops.hyper_connections.hc_collapse`: x [..., H, d], pre [..., H] →
    Σ_i pre[i] · x[i] in fp32, rounded to x.dtype [..., d]."""
    check_collapse_args(x, pre)
    h, d = x.shape[-2], x.shape[-1]
    x3 = _rows(x.reshape(-1, h, d))
    p2 = pre.reshape(-1, h).float().contiguous()
    out = torch.empty(x3.shape[0], d, dtype=x.dtype, device=x.device)
    if out.numel():
        _hc_collapse_kernel[(x3.shape[0], triton.cdiv(d, BLOCK_D))](
            x3, p2, out, d, x3.stride(0), x3.stride(1), p2.stride(0), out.stride(0),
            H=h, BLOCK=BLOCK_D, OUT=TL_DTYPES[x.dtype],
            EMULATE=interpreting() and x.dtype != torch.float32,
            enable_fp_fusion=False,
        )  # fmt: skip
    return out.view(*x.shape[:-2], d)


def hc_expand(y: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """Kernel twin of `ops.hyper_connections.hc_expand`: new streams [..., H, d],
    out[j] = post[j] · y + Σ_i comb[i, j] · residual[i] in fp32, rounded to y.dtype."""
    check_expand_args(y, residual, post, comb)
    h, d = residual.shape[-2], residual.shape[-1]
    y2 = _rows(y.reshape(-1, d))
    r3 = _rows(residual.reshape(-1, h, d))
    p2 = post.reshape(-1, h).float().contiguous()
    c3 = comb.reshape(-1, h, h).float().contiguous()
    out = torch.empty(r3.shape, dtype=y.dtype, device=y.device)
    if out.numel():
        _hc_expand_kernel[(r3.shape[0], triton.cdiv(d, BLOCK_D))](
            y2, r3, p2, c3, out, d, y2.stride(0), r3.stride(0), r3.stride(1), p2.stride(0),
            c3.stride(0), c3.stride(1), out.stride(0), out.stride(1),
            H=h, H_PAD=max(2, triton.next_power_of_2(h)), BLOCK=BLOCK_D, OUT=TL_DTYPES[y.dtype],
            EMULATE=interpreting() and y.dtype != torch.float32,
            enable_fp_fusion=False,
        )  # fmt: skip
    return out.view(residual.shape)
