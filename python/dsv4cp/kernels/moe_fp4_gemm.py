"""The routed experts' projection as one Triton launch: rows sorted by expert times each
expert's packed fp4 weight, decoded in the GEMM's K loop. Twin: `ops.moe_experts.grouped_fp4_mm`.

The chunked path (`torch._grouped_mm` per 32 experts over weights dequantized to bf16 first)
writes and re-reads every expert weight in bf16 — at Flash dims 27 GB per MoE layer, 16.4 ms of
the H200's ~62 ms per layer at 16K tokens, more than the layer's GEMM floor — and needs the
chunk boundaries on the host (a device sync per layer). Here each program owns one
[BM rows of one expert] × [BN outputs] tile: it finds its expert from the device-side tile
offsets (a fixed-step binary search, no host sync), reads the packed codes and e8m0 scales of
its BN weight rows in BK steps, decodes them to bf16 (every e2m1 code times a power of two is
exact in bf16) and accumulates the exact bf16 products on the tensor cores in fp32; the tile is
rounded to the output dtype once. So it equals the twin up to the fp32 summation order.

The grid has an upper bound of row tiles, ⌈P/BM⌉ + E (each expert adds at most one partial
tile); programs past the last real tile return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv4cp.kernels._triton import TL_DTYPES, interpreting, to_dtype
from dsv4cp.kernels.kv_decode import _minifloat, _ue8m0_value
from dsv4cp.ops.moe_experts import check_grouped_fp4_args
from dsv4cp.ops.moe_weights import ExpertStack

BM, BN, BK = 64, 128, 64
WARPS, STAGES = 8, 3
SEARCH_STEPS = 16  # binary-search steps over the experts: E < 2^16


@triton.jit
def _grouped_fp4_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    ends_ptr,
    tile_ends_ptr,
    E,
    N,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    TILE_M: tl.constexpr,
    TILE_N: tl.constexpr,
    TILE_K: tl.constexpr,
    STEPS: tl.constexpr,
    OUT: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    # the expert whose tiles hold `tile`: the first e with tile_ends[e] > tile
    lo = tl.zeros([], tl.int32)
    hi = tl.zeros([], tl.int32) + E
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        past = tl.load(tile_ends_ptr + mid, mask=mid < E, other=0) <= tile
        lo = tl.where(past & (lo < hi), mid + 1, lo)
        hi = tl.where(past | (lo >= hi), hi, mid)
    e = lo
    if e >= E:
        return
    tiles_before = tl.load(tile_ends_ptr + e - 1, mask=e > 0, other=0)
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(ends_ptr + e)
    rows = start + (tile - tiles_before) * TILE_M + tl.arange(0, TILE_M)
    row_ok = rows < end
    rows64 = rows.to(tl.int64)
    cols = tl.program_id(1) * TILE_N + tl.arange(0, TILE_N)
    col_ok = cols < N
    e64 = e.to(tl.int64)
    w_rows = w_ptr + e64 * stride_we + cols[:, None].to(tl.int64) * stride_wn
    s_rows = s_ptr + e64 * stride_se + cols[:, None].to(tl.int64) * stride_sn
    acc = tl.zeros([TILE_M, TILE_N], tl.float32)
    for k0 in range(0, K, TILE_K):
        ks = k0 + tl.arange(0, TILE_K)
        k_ok = ks < K
        a = tl.load(
            x_ptr + rows64[:, None] * stride_xm + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w_ok = col_ok[:, None] & k_ok[None, :]
        byte = tl.load(w_rows + (ks // 2)[None, :], mask=w_ok, other=0).to(tl.int32) & 0xFF
        code = tl.where((ks % 2 == 0)[None, :], byte & 0xF, byte >> 4)
        sb = tl.load(s_rows + (ks // 32)[None, :], mask=w_ok, other=127).to(tl.int32) & 0xFF
        w = (_minifloat(code, 2, 1, 1) * _ue8m0_value(sb)).to(a.dtype)  # exact
        if UPCAST:  # the CPU interpreter's bf16 tl.dot is wrong: the same exact products in fp32
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    dst = out_ptr + rows64[:, None] * stride_om + cols[None, :]
    tl.store(dst, to_dtype(acc, OUT, UPCAST), mask=row_ok[:, None] & col_ok[None, :])


def grouped_fp4_mm(xq: Tensor, counts: Tensor, stack: ExpertStack) -> Tensor:
    """Kernel twin of `ops.moe_experts.grouped_fp4_mm`: xq [P, K] sorted by expert (counts [E]
    rows each), the packed fp4 stack [E, N, K/2] with e8m0 scales [E, N, K/32] → [P, N] in
    xq.dtype (bf16 or fp16: the tensor cores' operand)."""
    n_out, k = check_grouped_fp4_args(xq, counts, stack)
    if xq.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"grouped_fp4_mm kernel: xq must be bf16 or fp16, got {xq.dtype}")
    if stack.scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise ValueError(f"grouped_fp4_mm kernel: scales must be e8m0, got {stack.scale.dtype}")
    x = xq if xq.stride(-1) == 1 else xq.contiguous()
    w = stack.weight.view(torch.uint8)
    s = stack.scale.view(torch.uint8)
    if w.stride(-1) != 1 or s.stride(-1) != 1:
        w, s = w.contiguous(), s.contiguous()
    p, n_experts = x.shape[0], counts.shape[0]
    out = torch.empty(p, n_out, dtype=xq.dtype, device=xq.device)
    if p == 0 or n_out == 0:
        return out
    counts32 = counts.to(torch.int32)
    ends = counts32.cumsum(0, dtype=torch.int32)
    tile_ends = ((counts32 + BM - 1) // BM).cumsum(0, dtype=torch.int32)
    grid = (triton.cdiv(p, BM) + n_experts, triton.cdiv(n_out, BN))
    _grouped_fp4_kernel[grid](
        x, w, s, out, ends, tile_ends, n_experts, n_out, k,
        x.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1), out.stride(0),
        TILE_M=BM, TILE_N=BN, TILE_K=BK, STEPS=SEARCH_STEPS, OUT=TL_DTYPES[xq.dtype],
        UPCAST=interpreting(), num_warps=WARPS, num_stages=STAGES,
    )  # fmt: skip
    return out
