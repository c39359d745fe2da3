"""The workspace's row numbering in Triton (twins: `dsv4cp.ops.workspace_rows`): one pass over a
chunk's [t, K] indices to mark the cache rows they name, one over the marks' prefix sum to list
each workspace row's cache row, one to rewrite the indices as workspace rows.

The torch twins build int64 copies, masks and gathers of the [t, K] indices, about ten kernels
per source (1.4 ms of a 16K-token index layer's 4.0 ms sparse-attention stage on the H200,
docs/performance.md §10); here each pass reads the indices once and the indices are never
widened. Stores of 1 to the same row from several programs are benign (the same value).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_T, BLOCK_K = 16, 128
PLACE_BLOCK = 1024


@triton.jit
def _index_tile(idx_ptr, T, K, N, stride_t, BT: tl.constexpr, BK: tl.constexpr):
    """This program's [BT, BK] tile of indices: (rows, columns, in bounds, indices, valid)."""
    r = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BK + tl.arange(0, BK)
    m = (r < T)[:, None] & (c < K)[None, :]
    i = tl.load(idx_ptr + r.to(tl.int64)[:, None] * stride_t + c[None, :], mask=m, other=-1)
    return r, c, m, i, m & (i >= 0) & (i < N)


@triton.jit
def _mark_kernel(idx_ptr, mark_ptr, T, K, N, stride_t, BT: tl.constexpr, BK: tl.constexpr):
    _, _, _, i, ok = _index_tile(idx_ptr, T, K, N, stride_t, BT, BK)
    tl.store(mark_ptr + i, tl.full([BT, BK], 1, tl.int32), mask=ok)


@triton.jit
def _remap_kernel(
    idx_ptr, num_ptr, out_ptr, T, K, N, BASE, BOUND, stride_t, stride_o,
    BT: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    r, c, m, i, ok = _index_tile(idx_ptr, T, K, N, stride_t, BT, BK)
    num = tl.load(num_ptr + i, mask=ok, other=BOUND)
    res = tl.where(ok & (num < BOUND), num + BASE, -1)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_o + c[None, :], res, mask=m)


@triton.jit
def _place_kernel(count_ptr, src_ptr, N, BOUND, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    total = tl.load(count_ptr + N - 1)
    m = i < N
    c = tl.load(count_ptr + i, mask=m, other=0)
    prev = tl.load(count_ptr + i - 1, mask=m & (i > 0), other=0)
    tl.store(src_ptr + c - 1, i, mask=m & (c > prev) & (c - 1 < BOUND))
    tl.store(src_ptr + i, tl.full([BLOCK], -1, tl.int32), mask=(i < BOUND) & (i >= total))


def _grid(idx: Tensor) -> tuple[int, int]:
    return triton.cdiv(idx.shape[0], BLOCK_T), triton.cdiv(idx.shape[1], BLOCK_K)


def _rows(idx: Tensor, what: str) -> Tensor:
    """`idx` as [t, K] with unit column stride (a copy only when it has another)."""
    if idx.dim() != 2:
        raise ValueError(f"{what}: indices must be [t, K], got {tuple(idx.shape)}")
    return idx if idx.shape[1] <= 1 or idx.stride(1) == 1 else idx.contiguous()


def mark_rows(idx: Tensor, mark: Tensor) -> None:
    """Twin of ops.workspace_rows.mark_rows (mark int32 [n], contiguous)."""
    idx = _rows(idx, "mark_rows")
    if mark.dtype != torch.int32 or not mark.is_contiguous():
        raise ValueError("mark_rows: mark must be a contiguous int32 vector")
    if idx.numel():
        _mark_kernel[_grid(idx)](
            idx, mark, idx.shape[0], idx.shape[1], mark.shape[0], idx.stride(0),
            BT=BLOCK_T, BK=BLOCK_K,
        )  # fmt: skip


def place_rows(count: Tensor, src: Tensor) -> None:
    """Twin of ops.workspace_rows.place_rows (count and src int32, contiguous, count non-empty):
    one pass over max(n, bound) where the torch twin takes a mask, a fill and a scatter."""
    if count.dtype != torch.int32 or not count.is_contiguous() or count.dim() != 1:
        raise ValueError("place_rows: count must be a contiguous int32 vector")
    if src.dtype != torch.int32 or not src.is_contiguous() or src.dim() != 1:
        raise ValueError("place_rows: src must be a contiguous int32 vector")
    n, bound = count.shape[0], src.shape[0]
    if n == 0 or bound == 0:
        src.fill_(-1)
        return
    _place_kernel[(triton.cdiv(max(n, bound), PLACE_BLOCK),)](
        count, src, n, bound, BLOCK=PLACE_BLOCK
    )


def remap_rows(idx: Tensor, number: Tensor, out: Tensor, base: int, bound: int) -> None:
    """Twin of ops.workspace_rows.remap_rows (number int32; out int32 with unit column stride)."""
    idx = _rows(idx, "remap_rows")
    if (
        out.dtype != torch.int32
        or out.shape != idx.shape
        or (out.shape[1] > 1 and out.stride(1) != 1)
    ):
        raise ValueError("remap_rows: out must be int32 [t, K] with unit column stride")
    if number.dtype != torch.int32 or not number.is_contiguous():
        raise ValueError("remap_rows: number must be a contiguous int32 vector")
    if idx.numel():
        _remap_kernel[_grid(idx)](
            idx, number, out, idx.shape[0], idx.shape[1], number.shape[0], base, bound,
            idx.stride(0), out.stride(0), BT=BLOCK_T, BK=BLOCK_K,
        )  # fmt: skip
