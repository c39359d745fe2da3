"""mHC's Sinkhorn split as one Triton launch: twin of `ops.hyper_connections.sinkhorn_split`.

The torch twin runs ~80 small launches per call (the loop's sums and divisions over [T, H, H]);
here one program takes BLOCK_T tokens, reads their (2+H)·H logits once, keeps each token's comb
as an [H_PAD, H_PAD] slice of a [BLOCK_T, H_PAD, H_PAD] tile through all the iterations and
writes pre, post and comb once. Row-local: a token's result depends on its own logits only.

The arithmetic is the twin's, in its order: products and sums rounded separately (FMA contraction
off at launch), sigmoid as 1 / (1 + exp(-x)) (torch's), the max-subtracted exp, every row or
column sum taken sequentially from index 0 (torch's order for these sums, checked on CPU), the
+eps after the softmax and in each denominator. Padded lanes (H < H_PAD) never enter a sum: each
term is picked out of the tile by an exact `where`. On the GPU exp and the divisions are
libdevice's (expf and IEEE division, as torch's CUDA kernels), in the interpreter `tl.math`'s;
exp differs from torch's CPU exp in the last ulps, so the kernel is not bit-exact with the twin
on CPU: tests/kernels/test_sinkhorn_kernel.py states and checks the bound.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv4cp.kernels._triton import check_tl_dtype, interpreting
from dsv4cp.kernels.precise_math import div, exp
from dsv4cp.ops.hyper_connections import HcMixes, check_sinkhorn_args

BLOCK_T = 64


@triton.jit
def _sequential_sum(comb, idx, AXIS: tl.constexpr, H: tl.constexpr):
    """Σ_k comb over AXIS (k = idx, broadcast along it), sequential from k = 0, the axis kept:
    each term is picked out by an exact `where`, so padded lanes (k >= H) never enter."""
    acc = tl.sum(tl.where(idx == 0, comb, 0.0), axis=AXIS, keep_dims=True)
    for k in tl.static_range(1, H):
        acc = acc + tl.sum(tl.where(idx == k, comb, 0.0), axis=AXIS, keep_dims=True)
    return acc


@triton.jit
def _sigmoid(x, PRECISE: tl.constexpr):
    return div(1.0, 1.0 + exp(-x, PRECISE), PRECISE)


@triton.jit
def _sinkhorn_kernel(
    logits_ptr,
    scale_ptr,
    base_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    T,
    stride_lt,
    eps,
    iters,
    H: tl.constexpr,
    H_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    PRECISE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    t_ok = tok < T
    row = logits_ptr + tok * stride_lt
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)

    # pre and post: [BLOCK, H_PAD]
    h = tl.arange(0, H_PAD)
    h_ok = h < H
    ok2 = t_ok[:, None] & h_ok[None, :]
    m = tl.load(row[:, None] + h[None, :], mask=ok2, other=0.0).to(tl.float32)
    b = tl.load(base_ptr + h, mask=h_ok, other=0.0)
    pre = _sigmoid(m * s0 + b[None, :], PRECISE) + eps
    tl.store(pre_ptr + tok[:, None] * H + h[None, :], pre, mask=ok2)
    m = tl.load(row[:, None] + H + h[None, :], mask=ok2, other=0.0).to(tl.float32)
    b = tl.load(base_ptr + H + h, mask=h_ok, other=0.0)
    post = 2.0 * _sigmoid(m * s1 + b[None, :], PRECISE)
    tl.store(post_ptr + tok[:, None] * H + h[None, :], post, mask=ok2)

    # comb: [BLOCK, H_PAD (row i), H_PAD (column j)]
    i3 = h[None, :, None]
    k3 = h[None, None, :]
    ij = i3 * H + k3
    ij_ok = (i3 < H) & (k3 < H)
    ok3 = t_ok[:, None, None] & ij_ok
    m = tl.load(row[:, None, None] + 2 * H + ij, mask=ok3, other=0.0).to(tl.float32)
    b = tl.load(base_ptr + 2 * H + ij, mask=ij_ok, other=0.0)
    c = m * s2 + b
    c = tl.where(k3 < H, c, float("-inf"))
    c = exp(c - tl.max(c, axis=2, keep_dims=True), PRECISE)
    # Padded lanes never enter a sum (`_sequential_sum` picks k < H); holding 1 there keeps
    # their own quotients finite (no 0 / 0 when eps = 0).
    c = tl.where(ij_ok, c, 1.0)
    c = div(c, _sequential_sum(c, k3, 2, H), PRECISE) + eps
    c = div(c, _sequential_sum(c, i3, 1, H) + eps, PRECISE)
    for _ in range(iters - 1):
        c = div(c, _sequential_sum(c, k3, 2, H) + eps, PRECISE)
        c = div(c, _sequential_sum(c, i3, 1, H) + eps, PRECISE)
    tl.store(comb_ptr + tok[:, None, None] * (H * H) + ij, c, mask=ok3)


def sinkhorn_split(
    logits: Tensor, scale: Tensor, base: Tensor, *, hc_mult: int, iters: int, eps: float
) -> HcMixes:
    """Kernel twin of `ops.hyper_connections.sinkhorn_split`: pre [..., H], post [..., H] and
    the Sinkhorn-normalised comb [..., H, H] from the mix logits [..., (2+H)·H], fp32, one launch.
    """
    check_sinkhorn_args(logits, scale, base, hc_mult=hc_mult, iters=iters)
    for name, x in (("logits", logits), ("scale", scale), ("base", base)):
        check_tl_dtype(x, f"sinkhorn_split kernel: {name}")
    h = hc_mult
    lead = logits.shape[:-1]
    rows = logits.reshape(-1, logits.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    t = rows.shape[0]
    dev = logits.device
    pre = torch.empty(t, h, dtype=torch.float32, device=dev)
    post = torch.empty(t, h, dtype=torch.float32, device=dev)
    comb = torch.empty(t, h, h, dtype=torch.float32, device=dev)
    if t:
        _sinkhorn_kernel[(triton.cdiv(t, BLOCK_T),)](
            rows, scale.float().contiguous(), base.float().contiguous(), pre, post, comb,
            t, rows.stride(0), float(eps), iters,
            H=h, H_PAD=max(2, triton.next_power_of_2(h)), BLOCK=BLOCK_T,
            PRECISE=not interpreting(),
            enable_fp_fusion=False,
        )  # fmt: skip
    return HcMixes(pre.view(*lead, h), post.view(*lead, h), comb.view(*lead, h, h))
