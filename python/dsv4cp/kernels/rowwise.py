"""Row-local fp32 GEMMs (Triton): twins of `ops.rowwise.rowwise_linear_fp32` and
`ops.hyper_connections.hc_mix_logits`.

Each program computes a [BM, BN] tile of rows × outputs with one K loop of fixed BK steps (no
split-K; the tile sizes depend on N only, never on the row count), so an output row depends only
on its own input row: the same token gives the same bits in a one-shot prefill, a chunk or any
CP rank's share of the rows — the property the twins get from cuBLAS by padding every call to
one shape, without their per-call Python loop (at 16K rows, 64 launches per call) or the fp32
copy of bf16 input. The products run on the tensor cores as three TF32 products
(`input_precision="tf32x3"`: x = x_hi + x_lo, the x_lo·w_lo term dropped), fp32-accurate to a
few 2⁻²⁴ per product: the exact fp32 (`ieee`) form measured 5–7 TFLOP/s on the H200 (FMA
units), 3.3 ms per mix-logit call and 9.3 ms per gate at 16K rows. The sums run in another
order than cuBLAS', so kernel and twin agree to the fp32 order bound, not bit for bit.

`hc_mix_logits` also folds the token's rms scale into the same pass: Σx² accumulates beside the
products, and the tile is scaled by rsqrt(Σx²/K + eps) before it is stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv4cp.kernels._triton import check_tl_dtype
from dsv4cp.ops.hyper_connections import check_mix_args
from dsv4cp.ops.rowwise import check_rowwise_args

PRECISION = "tf32x3"


def tiles(n: int) -> tuple[int, int, int]:
    """(BM, BN, BK) for N outputs: the mix logits' N = 24 in one 32-wide tile with short row
    blocks (more programs over 16K rows); wide N (the gate's 384) in 128-wide tiles."""
    return (32, 32, 64) if n <= 32 else (64, 128, 32)


@triton.jit
def _rowwise_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    eps,
    RMS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PREC: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BM, BN], tl.float32)
    sq = tl.zeros([BM], tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        w = tl.load(
            w_ptr + cols[None, :] * stride_wn + ks[:, None],
            mask=col_ok[None, :] & k_ok[:, None],
            other=0.0,
        ).to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=PREC)
        if RMS:
            sq += tl.sum(x * x, axis=1)
    if RMS:
        acc = acc * (1.0 / tl.sqrt(sq / K + eps))[:, None]
    dst = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(dst, acc, mask=row_ok[:, None] & col_ok[None, :])


def _launch(rows: Tensor, w: Tensor, *, rms_eps: float | None) -> Tensor:
    check_tl_dtype(rows, "rowwise kernels: x")
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    wf = w.float().contiguous()
    m, k = rows.shape
    n = wf.shape[0]
    out = torch.empty(m, n, dtype=torch.float32, device=rows.device)
    if m:
        bm, bn, bk = tiles(n)
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        _rowwise_kernel[grid](
            rows, wf, out, m, n, k, rows.stride(0), wf.stride(0), out.stride(0),
            0.0 if rms_eps is None else rms_eps,
            RMS=rms_eps is not None, BM=bm, BN=bn, BK=bk, PREC=PRECISION,
        )  # fmt: skip
    return out


def rowwise_linear_fp32(x: Tensor, w: Tensor) -> Tensor:
    """Kernel twin of `ops.rowwise.rowwise_linear_fp32`: fp32 x [..., K] · wᵀ → [..., N]."""
    check_rowwise_args(x, w)
    out = _launch(x.reshape(-1, x.shape[-1]), w, rms_eps=None)
    return out.view(*x.shape[:-1], w.shape[0])


def hc_mix_logits(x: Tensor, fn: Tensor, *, norm_eps: float) -> Tensor:
    """Kernel twin of `ops.hyper_connections.hc_mix_logits`: x [..., H, d] → fp32
    [..., (2+H)·H], ``fn @ flatten(x)`` scaled by rsqrt(mean(x²) + norm_eps), one pass."""
    check_mix_args(x, fn)
    flat = x.reshape(-1, x.shape[-2] * x.shape[-1])
    out = _launch(flat, fn, rms_eps=norm_eps)
    return out.view(*x.shape[:-2], fn.shape[0])
