"""Indexer MQA logits: logits[t, j] = Σ_h w[t,h]·relu(q[t,h]·k[k_start[t]+j]) (attention-math §5.3).

One program owns an output tile of BLOCK_T rows × BLOCK_N key columns and loops over the heads:
each head is one [BLOCK_T, D] × [D, BLOCK_N] tensor-core product whose relu is weighted and
summed into the fp32 tile in registers, so [T, H, N] is never formed. The key tile is loaded
once per program and the per-head query tiles are software-pipelined (cp.async). Tiles past the
row block's largest n_visible only write -inf. Row blocks whose rows do not share one k_start
are done by a second, per-row kernel (all heads of one row in one product); it exits at once on
the other blocks, and it is launched only when k_start is given.

quant="qat" follows `ops.attention_quant.index_scores_qat`: each head's product is rounded to
bf16, relu'd, multiplied by the bf16-rounded head weight and rounded to bf16 again, the heads are
added in order 0…H−1 in fp32 (the per-row kernel too, one head at a time), and the sum is rounded
to bf16. q and k are then fake-fp4 values (bf16-exact), whose products are exact; the tensor
core's fp32 sum over D equals the twin's exact dot whenever that dot fits fp32 (docs/
quantization.md, "Index scores and top-k ties"). The tile kernel takes the heads loop and the
packed bf16 steps (`index_score`: two values per inline-PTX block on the GPU, the same bits;
1.25–1.36× on the logits route's node, docs/performance.md §36).
"""

from __future__ import annotations

from typing import cast

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv4cp.kernels._triton import dot_flags, interpreting
from dsv4cp.kernels.index_score import add_heads, head_term, index_score
from dsv4cp.ops.quant import QuantMode, check_quant_mode

# (BLOCK_T, BLOCK_N, num_warps, num_stages): the H200 default, picked by benchmarks/kernels.py
# --sweep (608 TFLOP/s at T=2048, N=16384, H_I=32 against 560 with 3 stages).
DEFAULT_CONFIG = (64, 128, 4, 2)
_DOT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def tile_rows(nvis_ptr, kstart_ptr, T, WIDTH, HAS_KSTART: tl.constexpr, BLOCK_T: tl.constexpr,
              BLOCK_N: tl.constexpr):  # fmt: skip
    """This program's output tile (BLOCK_T rows, BLOCK_N columns; program ids (column tile,
    row block)): rows, row_ok, cols, the rows' visible counts (≤ WIDTH), their largest, the
    block's smallest k_start (0 without) and whether every row shares it."""
    rows = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nvis = tl.minimum(tl.load(nvis_ptr + rows, mask=row_ok, other=0).to(tl.int32), WIDTH)
    max_vis = tl.max(nvis, 0)
    if HAS_KSTART:
        ks = tl.load(kstart_ptr + rows, mask=row_ok, other=0).to(tl.int32)
        ks_lo = tl.min(tl.where(row_ok, ks, 2147483647), 0)
        uniform = ks_lo == tl.max(tl.where(row_ok, ks, -1), 0)
    else:
        ks_lo = max_vis * 0
        uniform = max_vis == max_vis
    return rows, row_ok, cols, nvis, max_vis, ks_lo, uniform


@triton.jit
def store_tile(out_ptr, acc, rows, row_ok, cols, nvis, stride_ot, WIDTH, FILL: tl.constexpr):
    """The tile's logits, -inf past each row's visible count; FILL=False: those stay unwritten
    (for a reader that never reads them: the logits route's top-k)."""
    visible = cols[None, :] < nvis[:, None]
    store_ok = row_ok[:, None] & (cols < WIDTH)[None, :]
    if not FILL:
        store_ok = store_ok & visible
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * stride_ot + cols[None, :],
        tl.where(visible, acc, float("-inf")),
        mask=store_ok,
    )


@triton.jit
def _mqa_logits_kernel(
    q_ptr,
    w_ptr,
    k_ptr,
    nvis_ptr,
    kstart_ptr,
    out_ptr,
    T,
    H,
    N,
    WIDTH,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_kn,
    stride_ot,
    HAS_KSTART: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    QAT: tl.constexpr,
    EMULATE: tl.constexpr,
    PACKED: tl.constexpr,
    FILL: tl.constexpr,
):
    # Row blocks that share one k_start (all of them without k_start); the others are left to
    # mqa_logits_rows_kernel.
    rows, row_ok, cols, nvis, max_vis, ks_lo, uniform = tile_rows(
        nvis_ptr, kstart_ptr, T, WIDTH, HAS_KSTART, BLOCK_T, BLOCK_N
    )
    d = tl.arange(0, D)
    if uniform:
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        if tl.program_id(0) * BLOCK_N < max_vis:
            key_rows = ks_lo + cols
            key_ok = (cols < max_vis) & (key_rows < N)
            kt = tl.load(
                k_ptr + key_rows[None, :].to(tl.int64) * stride_kn + d[:, None],
                mask=key_ok[None, :],
                other=0.0,
            )
            if UPCAST:
                kt = kt.to(tl.float32)
            q_ptrs = q_ptr + rows[:, None].to(tl.int64) * stride_qt + d[None, :]
            w_ptrs = w_ptr + rows.to(tl.int64) * stride_wt
            acc = add_heads(acc, q_ptrs, w_ptrs, kt, row_ok, H, stride_qh, QAT, EMULATE, PACKED,
                            UPCAST, DOT_PREC, STAGES)  # fmt: skip
        acc = index_score(acc, QAT, EMULATE, PACKED)
        store_tile(out_ptr, acc, rows, row_ok, cols, nvis, stride_ot, WIDTH, FILL)


@triton.jit
def mqa_logits_rows_kernel(
    q_ptr,
    w_ptr,
    k_ptr,
    nvis_ptr,
    kstart_ptr,
    out_ptr,
    T,
    H,
    N,
    WIDTH,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_kn,
    stride_ot,
    D: tl.constexpr,
    H_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    QAT: tl.constexpr,
    EMULATE: tl.constexpr,
):
    # Row blocks whose rows do not share one k_start: one row at a time, all heads in one product.
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    ks = tl.load(kstart_ptr + rows, mask=row_ok, other=0).to(tl.int32)
    ks_lo = tl.min(tl.where(row_ok, ks, 2147483647), 0)
    if ks_lo != tl.max(tl.where(row_ok, ks, -1), 0):
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        d = tl.arange(0, D)
        hh = tl.arange(0, H_PAD)
        h_ok = hh < H
        for r in range(BLOCK_T):
            t = pid_t * BLOCK_T + r
            if t < T:
                t64 = t.to(tl.int64)
                ks_t = tl.load(kstart_ptr + t).to(tl.int32)
                nv_t = tl.minimum(tl.load(nvis_ptr + t).to(tl.int32), WIDTH)
                key_rows = ks_t + cols
                key_ok = (cols < nv_t) & (key_rows < N)
                kt = tl.load(
                    k_ptr + key_rows[None, :].to(tl.int64) * stride_kn + d[:, None],
                    mask=key_ok[None, :],
                    other=0.0,
                )
                qt = tl.load(
                    q_ptr + t64 * stride_qt + hh[:, None] * stride_qh + d[None, :],
                    mask=h_ok[:, None],
                    other=0.0,
                )
                if UPCAST:
                    kt = kt.to(tl.float32)
                    qt = qt.to(tl.float32)
                wt = tl.load(w_ptr + t64 * stride_wt + hh, mask=h_ok, other=0.0)
                s = tl.dot(qt, kt, input_precision=DOT_PREC)
                if QAT:
                    terms = head_term(s, wt[:, None], QAT, EMULATE, False)
                    row = tl.zeros([BLOCK_N], dtype=tl.float32)
                    for h in range(H):  # heads in order, as the main kernel adds them
                        row += tl.sum(tl.where(hh[:, None] == h, terms, 0.0), 0)
                    row = index_score(row, QAT, EMULATE, False)
                else:
                    row = tl.sum(tl.maximum(s, 0.0) * wt[:, None], 0)
                row = tl.where(cols < nv_t, row, float("-inf"))
                tl.store(out_ptr + t64 * stride_ot + cols, row, mask=cols < WIDTH)


def check_mqa_logits(q: Tensor, weights: Tensor, k: Tensor, n_visible: Tensor) -> None:
    """Raise ValueError naming the limit when the kernel cannot take these shapes."""
    if q.dim() != 3:
        raise ValueError(f"mqa_logits: q must be [T, H_I, D_I], got {tuple(q.shape)}")
    t, h, d = q.shape
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"mqa_logits kernel: D_I must be a power of two in [16, 256], got {d}")
    if h < 1 or h > 128:
        raise ValueError(f"mqa_logits kernel: H_I must be in [1, 128], got {h}")
    if k.dim() != 2 or k.shape[1] != d:
        raise ValueError(f"mqa_logits: k must be [N, {d}], got {tuple(k.shape)}")
    if weights.shape != (t, h):
        raise ValueError(f"mqa_logits: weights must be [{t}, {h}], got {tuple(weights.shape)}")
    if n_visible.shape != (t,):
        raise ValueError(f"mqa_logits: n_visible must be [{t}], got {tuple(n_visible.shape)}")
    if q.dtype not in _DOT_DTYPES or k.dtype != q.dtype:
        raise ValueError(
            f"mqa_logits kernel: q and k must share one of bf16/fp16/fp32, got {q.dtype}, {k.dtype}"
        )


def mqa_logits(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    n_visible: Tensor,
    *,
    k_start: Tensor | None = None,
    width: int | None = None,
    quant: QuantMode = "none",
) -> Tensor:
    """Triton twin of ops.indexer.mqa_logits: fp32 [T, width], -inf for j >= n_visible[t]."""
    return launch_mqa_logits(q, weights, k, n_visible, k_start=k_start, width=width, quant=quant)


def launch_mqa_logits(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    n_visible: Tensor,
    *,
    k_start: Tensor | None = None,
    width: int | None = None,
    quant: QuantMode = "none",
    config: tuple[int, int, int, int] | None = None,
    packed: bool = True,
    fill: bool = True,
) -> Tensor:
    """mqa_logits with an explicit (BLOCK_T, BLOCK_N, num_warps, num_stages) (benchmarks).
    `packed`: qat's bf16 steps two values per inline-PTX block (`index_score`, GPU only; the
    same bits as `packed=False`, which rounds one value at a time). `fill=False`: the row
    blocks that share one k_start leave their entries j ≥ n_visible[t] unwritten instead of
    -inf (for a reader that never reads them: the logits route's top-k)."""
    check_mqa_logits(q, weights, k, n_visible)
    qat = check_quant_mode(quant) == "qat"
    out, args = logits_launch_args(q, weights, k, n_visible, k_start, width, qat)
    if not out.numel():
        return out
    d = q.shape[2]
    block_t, block_n, warps, stages = config or DEFAULT_CONFIG
    grid = (triton.cdiv(out.shape[1], block_n), triton.cdiv(out.shape[0], block_t))
    flags = dot_flags(q.dtype)
    dots = {"UPCAST": flags["UPCAST"], "DOT_PREC": flags["DOT_PREC"]}  # these kernels: no RNE
    _mqa_logits_kernel[grid](
        *args,
        HAS_KSTART=k_start is not None,
        D=d,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        STAGES=stages,
        **dots,
        QAT=qat,
        EMULATE=interpreting(),
        PACKED=packed and q.is_cuda,
        FILL=fill,
        num_warps=warps,
        num_stages=stages,
    )
    if k_start is not None:
        launch_mixed_rows(args, grid, block_t, block_n, qat)
    return out


def logits_launch_args(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    n_visible: Tensor,
    k_start: Tensor | None,
    width: int | None,
    qat: bool,
) -> tuple[Tensor, tuple[object, ...]]:
    """The tile kernels' output, fp32 [T, width] (empty: nothing to launch), and their common
    arguments: q, the weights (fp32, bf16-rounded in qat), k, n_visible, k_start (n_visible
    without), out, T, H, N, width and the strides, each operand unit-stride in its last dim."""
    t, h, _ = q.shape
    n = k.shape[0]
    width = n if width is None else int(width)
    out = torch.empty((t, width), dtype=torch.float32, device=q.device)
    if t == 0 or width == 0:
        return out, ()
    if q.stride(2) != 1:
        q = q.contiguous()
    if k.stride(1) != 1:
        k = k.contiguous()
    weights = weights.to(torch.bfloat16).float() if qat else weights.float()
    if weights.stride(1) != 1:
        weights = weights.contiguous()
    n_visible = n_visible.contiguous()
    if k_start is not None:
        if k_start.shape != (t,):
            raise ValueError(f"mqa_logits: k_start must be [{t}], got {tuple(k_start.shape)}")
        k_start = k_start.contiguous()
    ks = n_visible if k_start is None else k_start
    strides = (q.stride(0), q.stride(1), weights.stride(0), k.stride(0), out.stride(0))
    return out, (q, weights, k, n_visible, ks, out, t, h, n, width, *strides)


def launch_mixed_rows(
    args: tuple[object, ...], grid: tuple[int, int], block_t: int, block_n: int, qat: bool
) -> None:
    """The row blocks whose rows do not share one k_start (`logits_launch_args`' arguments,
    the tile kernel's grid): `mqa_logits_rows_kernel`, all heads of one row in one product."""
    q = cast(Tensor, args[0])
    flags = dot_flags(q.dtype)
    mqa_logits_rows_kernel[grid](
        *args,
        D=q.shape[2],
        H_PAD=max(16, triton.next_power_of_2(q.shape[1])),
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        UPCAST=flags["UPCAST"],
        DOT_PREC=flags["DOT_PREC"],
        QAT=qat,
        EMULATE=interpreting(),
        num_warps=4,
        num_stages=1,
    )
