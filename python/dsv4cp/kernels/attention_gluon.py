"""Sparse MQA attention with a per-head sink logit over one dense bf16 kv source, written in Gluon
for Hopper (sm_90): the Triton kernel's math (kernels/attention.py, twin
ops.attention.sparse_attention) with the layouts and the asynchronous wgmma chosen by hand.
This file holds the shared pieces (availability, argument checks, the cp.async gathers of a tile
and of the query, the sink's start, the online-softmax step, the two math warpgroups' final
division) and the pipelined kernel; kernels/attention_gluon_ws.py holds the warp-specialised one,
kernels/attention_gluon_halves.py the half-buffer one.

The pipelined kernel: one program per query, all 64 heads, 8 warps = two warpgroups, no warp
specialisation. What Triton's own layouts could not give (docs/performance.md §1, *Why it
misses*):
- the [64 heads, BN keys] score tile is split by keys between the warpgroups
  (`warps_per_cta = [4, 2]`), so q·kᵀ runs once, not once per warpgroup;
- the [64, 512] fp32 accumulator is split by columns (256 each, 128 registers a thread);
- the gathered kv rows go to shared memory by cp.async (`NBUF` buffers of BN rows); with two
  buffers a tile's copy is issued while the previous tile's p·v runs.
The row max is the one cross-warpgroup exchange per step; the running sum is kept per thread
(a [64, BN] partial) and reduced once at the end.

Invariant (both warpgroups read every kv buffer and p tile, the other's wgmma may be in flight):
a shared buffer an asynchronous wgmma reads is rewritten only after a CTA-wide barrier that
follows both warpgroups' wait on that wgmma — for p, the row-max exchange's barriers; for kv,
the barrier Triton's membar pass puts before the next copy. The CPU test checks the compiled
order (tests/kernels/test_attention_gluon.py). p is rounded to bf16 for p·v, as in the Triton
kernel and FlashMLA. -1 indices (and indices ≥ N) are masked; a row with no valid key gives 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4cp.kernels._gluon import HAVE_GLUON, compile_sm90

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )

    from dsv4cp.kernels._gluon import cta_barrier as _cta_barrier

HEADS = 64  # the MMA's M: one warpgroup's 64 rows
HEAD_DIM = 512
# (keys per step, kv buffers) of the pipelined kernel. (128, 1) gives each warpgroup a 64-wide
# score tile and one 128-row buffer (all that fits beside the query); both passed the H100's GPU
# tests and (128, 1) is the faster, 0.592 of FlashMLA against 0.487 (docs/performance.md §25).
PIPELINED_CONFIG = (128, 1)
PIPELINED_CONFIGS = ((64, 2), (128, 1))  # what the tests and the benchmark run
NUM_WARPS = 8
_LOG2E = 1.4426950408889634


def kernel_misfit(q: Tensor, capability: tuple[int, int] | None) -> str | None:
    """Why these kernels cannot run for `q` on a device of `capability` (None: no CUDA device),
    or None: they need Gluon, a Hopper GPU and the Flash shape."""
    if not HAVE_GLUON:
        return "this Triton has no Gluon"
    if capability is None or capability[0] != 9:
        return f"the Gluon kernel needs SM90, got {capability or 'no CUDA device'}"
    if q.dim() != 3 or tuple(q.shape[1:]) != (HEADS, HEAD_DIM):
        return f"the Gluon kernel takes [T, {HEADS}, {HEAD_DIM}], got {tuple(q.shape)}"
    return None


def gluon_attention_available(q: Tensor) -> bool:
    """True where this kernel runs: Gluon importable, a Hopper GPU, the Flash shape."""
    cap = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
    return kernel_misfit(q, cap) is None


if HAVE_GLUON:

    @gluon.jit
    def _issue_tile(kv_ptr, idx_row, kv_buf, start, N, K, stride_kvn,
                    BN: gl.constexpr, D: gl.constexpr, LD: gl.constexpr):  # fmt: skip
        """cp.async of one tile's gathered rows into `kv_buf` (masked rows are zero-filled)."""
        offs = start + gl.arange(0, BN, layout=gl.SliceLayout(1, LD))
        idx = gl.load(idx_row + offs, mask=offs < K, other=-1)
        ok = (idx >= 0) & (idx < N)
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, LD))
        ptrs = kv_ptr + idx.to(gl.int64)[:, None] * stride_kvn + cols[None, :]
        async_copy.async_copy_global_to_shared(kv_buf, ptrs, mask=ok[:, None])

    @gluon.jit
    def _copy_query(q_row, q_smem, stride_qh, H: gl.constexpr, D: gl.constexpr,
                    LD: gl.constexpr):  # fmt: skip
        """cp.async of the query's [H, D] rows into `q_smem` (the warp-specialised loaders'
        start; each kernel announces their landing its own way)."""
        heads = gl.arange(0, H, layout=gl.SliceLayout(1, LD))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, LD))
        async_copy.async_copy_global_to_shared(
            q_smem, q_row + heads[:, None] * stride_qh + cols[None, :]
        )

    @gluon.jit
    def _normalize_half(o, l_own, l_one, l_smem, l_bar, WG: gl.constexpr, ROWS: gl.constexpr,
                        O_L: gl.constexpr):  # fmt: skip
        """Math warpgroup WG's output half over the row's whole running sum: its own, the other
        warpgroup's (exchanged once through l_smem behind l_bar) and the sink's (a row with no
        valid key: 0)."""
        l_smem.index(WG).store(l_own)
        mbarrier.arrive(l_bar, count=1)
        mbarrier.wait(l_bar, 0)
        l_sum = l_one + (l_own + l_smem.index(1 - WG).load(ROWS))
        l_sum = gl.where(l_sum > 0.0, l_sum, 1.0)
        return o / gl.convert_layout(l_sum, gl.SliceLayout(1, O_L))[:, None]

    @gluon.jit
    def _sink_start(sink_ptr, H: gl.constexpr, ROWS: gl.constexpr):
        """The running max starts at the sink logit (base 2), the running sum at e^0 (0 for a
        −∞ sink): (m, l)."""
        sink = gl.load(sink_ptr + gl.arange(0, H, layout=ROWS)) * 1.4426950408889634
        return sink, gl.where(sink > float("-inf"), 1.0, 0.0)

    @gluon.jit
    def _rescale(s, m, m_new):
        """One online-softmax step in base 2 from the running max m to m_new: (alpha, p). A row
        whose max is still −∞ gets 0 for both, not NaN."""
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        return gl.exp2(m - m_use), gl.exp2(s - m_use[:, None])

    @gluon.jit(do_not_specialize=["N", "K", "stride_it"])
    def _sparse_attention_gluon_kernel(
        q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, N, K, qk_scale,
        stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh,
        H: gl.constexpr, D: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr,
        num_warps: gl.constexpr,
    ):  # fmt: skip
        t = gl.program_id(0).to(gl.int64)
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
        S_L: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BN // 2, 16]
        )
        O_L: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D // 2, 16]
        )
        Q_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, D], gl.bfloat16)
        KV_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], gl.bfloat16)
        P_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, BN], gl.bfloat16)

        heads = gl.arange(0, H, layout=gl.SliceLayout(1, LD))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, LD))
        q = gl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + cols[None, :])
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [H, D], Q_SL, value=q)
        kv_smem = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BN, D], KV_SL)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [H, BN], P_SL)

        idx_row = idx_ptr + t * stride_it
        n_tiles = gl.cdiv(K, BN)
        _issue_tile(kv_ptr, idx_row, kv_smem.index(0), 0, N, K, stride_kvn, BN, D, LD)
        async_copy.commit_group()

        s_rows: gl.constexpr = gl.SliceLayout(1, S_L)
        s_cols: gl.constexpr = gl.SliceLayout(0, S_L)
        m, l_one = _sink_start(sink_ptr, H, s_rows)
        l_part = gl.zeros([H, BN], gl.float32, S_L)
        acc = warpgroup_mma_init(gl.zeros([H, D], gl.float32, O_L))  # p·v's, carried in flight
        s_zero = gl.zeros([H, BN], gl.float32, S_L)
        fence_async_shared()
        for j in range(n_tiles):
            buf = j % NBUF
            async_copy.wait_group(0)  # tile j landed (this thread's copies)
            _cta_barrier()  # ... and every thread's
            fence_async_shared()
            kv = kv_smem.index(buf)
            s = warpgroup_mma(q_smem, kv.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            # p·v of step j-1 was issued first: it is done once s may still be in flight
            o = warpgroup_mma_wait(1, deps=[acc])
            if NBUF == 2:
                if j + 1 < n_tiles:  # its buffer's last reader (p·v of step j-1) is done
                    _issue_tile(kv_ptr, idx_row, kv_smem.index(1 - buf), (j + 1) * BN, N, K,
                                stride_kvn, BN, D, LD)  # fmt: skip
                async_copy.commit_group()
            s = warpgroup_mma_wait(0, deps=[s])
            offs = j * BN + gl.arange(0, BN, layout=s_cols)
            idx = gl.load(idx_row + offs, mask=offs < K, other=-1)
            ok = (idx >= 0) & (idx < N)
            s = gl.where(ok[None, :], s * qk_scale, float("-inf"))
            m_new = gl.maximum(m, gl.max(s, 1))
            alpha, p = _rescale(s, m, m_new)
            l_part = l_part * alpha[:, None] + p
            l_one = l_one * alpha
            m = m_new
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            p_smem.store(p.to(gl.bfloat16))
            fence_async_shared()
            _cta_barrier()
            acc = warpgroup_mma(p_smem, kv, o, is_async=True)
            if NBUF == 1:  # one buffer: the next tile's copy waits for this p·v
                acc = warpgroup_mma_init(warpgroup_mma_wait(0, deps=[acc]))
                if j + 1 < n_tiles:
                    _issue_tile(kv_ptr, idx_row, kv_smem.index(0), (j + 1) * BN, N, K,
                                stride_kvn, BN, D, LD)  # fmt: skip
                async_copy.commit_group()
        o = warpgroup_mma_wait(0, deps=[acc])
        async_copy.wait_group(0)
        l_sum = l_one + gl.sum(l_part, 1)
        l_sum = gl.where(l_sum > 0.0, l_sum, 1.0)
        o = o / gl.convert_layout(l_sum, gl.SliceLayout(1, O_L))[:, None]
        o_heads = gl.arange(0, H, layout=gl.SliceLayout(1, O_L))
        o_cols = gl.arange(0, D, layout=gl.SliceLayout(0, O_L))
        o_ptrs = out_ptr + t * stride_ot + o_heads[:, None] * stride_oh + o_cols[None, :]
        gl.store(o_ptrs, o.to(gl.bfloat16))


def check_sparse_attention_gluon(q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor) -> None:
    """Raise ValueError naming the limit when this kernel cannot take these inputs."""
    name = "sparse_attention_gluon"
    if not HAVE_GLUON:
        raise ValueError(f"{name}: this Triton has no Gluon (triton.experimental.gluon)")
    if q.dim() != 3 or q.shape[1:] != (HEADS, HEAD_DIM):
        raise ValueError(f"{name}: q must be [T, {HEADS}, {HEAD_DIM}], got {tuple(q.shape)}")
    if kv.dim() != 2 or kv.shape[1] != HEAD_DIM:
        raise ValueError(f"{name}: kv must be [N, {HEAD_DIM}], got {tuple(kv.shape)}")
    if indices.dim() != 2 or indices.shape[0] != q.shape[0]:
        raise ValueError(f"{name}: indices must be [{q.shape[0]}, K], got {tuple(indices.shape)}")
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        raise ValueError(f"{name}: q and kv must be bf16, got {q.dtype}, {kv.dtype}")
    if sink.shape != (HEADS,):
        raise ValueError(f"{name}: sink must be [{HEADS}], got {tuple(sink.shape)}")


def launch_per_query(
    kernel: object, q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float, **meta: int
) -> Tensor:
    """Check the inputs and launch a Gluon attention kernel of this module's argument list (q,
    kv, idx, sink, out, N, K, qk_scale, six strides; `meta`: its constexprs and launch options)
    with one program per query: [T, 64, 512] bf16."""
    check_sparse_attention_gluon(q, kv, indices, sink)
    t = q.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    kv = kv if kv.stride(1) == 1 else kv.contiguous()
    idx = indices.to(torch.int32).contiguous()
    kernel[(t,)](  # type: ignore[index]
        q, kv, idx, sink.float().contiguous(), out, kv.shape[0], idx.shape[1],
        float(scale) * _LOG2E,
        q.stride(0), q.stride(1), kv.stride(0), max(idx.stride(0), 1), out.stride(0),
        out.stride(1), H=HEADS, D=HEAD_DIM, **meta,
    )  # fmt: skip
    return out


def compile_for_sm90(kernel: object, options: dict[str, int], **const: int) -> object:
    """Compile a kernel of this module's argument list for sm_90 without a GPU: Triton's
    compiled kernel (`_gluon.compile_sm90`)."""
    types = ["*bf16", "*bf16", "*i32", "*fp32", "*bf16", "i32", "i32", "fp32"] + ["i32"] * 6
    return compile_sm90(kernel, types, options, dict(H=HEADS, D=HEAD_DIM, **const))


def sparse_attention_gluon(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    sink: Tensor,
    scale: float,
    *,
    config: tuple[int, int] = PIPELINED_CONFIG,
) -> Tensor:
    """Gluon twin of ops.attention.sparse_attention at the Flash shape: [T, 64, 512] bf16."""
    return launch_per_query(_sparse_attention_gluon_kernel, q, kv, indices, sink, scale,
                            BN=config[0], NBUF=config[1], num_warps=NUM_WARPS)  # fmt: skip


def compile_for_hopper(
    block_n: int = PIPELINED_CONFIG[0], nbuf: int = PIPELINED_CONFIG[1]
) -> object:
    """The pipelined kernel compiled for sm_90 without a GPU (tests)."""
    return compile_for_sm90(
        _sparse_attention_gluon_kernel,
        dict(num_warps=NUM_WARPS),
        BN=block_n,
        NBUF=nbuf,
        num_warps=NUM_WARPS,
    )
