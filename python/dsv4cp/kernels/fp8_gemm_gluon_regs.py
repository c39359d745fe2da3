"""The Gluon fp8-weight GEMM of `kernels/fp8_gemm_gluon.py` with the decoded weight in registers:
out = a · deq(w)ᵀ computed as outᵀ tiles = deq(w) · aᵀ, so the weight is wgmma's A operand,
which Hopper reads from registers, and the activation its B operand from shared memory. Same
products and accumulation as `fp8_gemm_gluon` (the tensor cores' fp32 order over 32-wide steps).

Why (docs/performance.md §34–§35): `fp8_gemm_gluon` decodes the weight into a bf16 tile in shared
memory that the tensor cores then read; a K step moves ~80 KiB through shared memory against
~64 KiB for a bf16 GEMM, which caps it near 0.8 of cuBLAS. Here the bf16 weight never touches
shared memory: the MMA warpgroups load the e4m3 codes of the next step in wgmma's register layout,
scale and round them while the current step's wgmma runs. A K step of a [128, 256] outᵀ tile moves
20 KiB of copies, 4 KiB of code loads and 32 KiB of wgmma operand reads (the activation's, once
per warpgroup): ~56 KiB for the same tensor-core work (§35).

- loader (4 warps): cp.async of the weight codes [BW, 32] and the activation tile [BT, 32] of
  each K step into stage (step % S), each thread's copies arriving on ready[stage] (count 128, no
  increment), once the stage's use S steps earlier is consumed (mma_done);
- MMA (the default partition, 2 warpgroups, each 64 of the BW weight rows): per step the
  asynchronous wgmma of the decoded weight (registers) and the activation tile into the fp32
  [BW, BT] accumulator, then the next step's codes × their row block's scale → bf16 (exact) into
  registers, then the wait for the step before (one wgmma stays in flight; its register operand
  is kept alive until that wait), which frees the step before's stage.
The epilogue writes the accumulator transposed through a layout whose threads run along `out`'s
rows. Programs ordered token-tile fastest so consecutive programs share a weight tile. Needs
K % 32 == 0. Twin: `ops.linear.dequant_fp8_blocks` + torch.mm
(tests/gpu/test_fp8_gemm_gluon_gpu.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4cp.kernels._gluon import HAVE_GLUON, compile_sm90
from dsv4cp.kernels.fp8_gemm_gluon import BK, gemm_operands

BW = 128  # weight rows (output columns) per program: two warpgroups of 64, wgmma's M
BT = 256  # activation rows (tokens) per program: wgmma's N
STAGES = 6  # 6 × (16 + 4) KiB, plus the epilogue's 64 KiB transpose
MMA_WARPS = 8
# registers a thread: the launch's limit for 12 warps; the loader gets LOAD_REGS, the MMA
# warpgroups (3·168 − LOAD_REGS) / 2 (the fp32 accumulator alone is 128)
MAXNREG = 168
LOAD_REGS = 72

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from dsv4cp.kernels._gluon import cta_barrier as _cta_barrier
    from dsv4cp.kernels.fp8_gemm_gluon import _copy_pointers, _issue, _scale

    @gluon.jit
    def _loader(a_ptr, w_ptr, a_smem, w8_smem, ready, mma_done, M, N, off_t, off_w, steps,
                stride_a, stride_w, BT: gl.constexpr, BW: gl.constexpr, BK: gl.constexpr,
                S: gl.constexpr):  # fmt: skip
        """Step k's two tiles by cp.async into stage k % S once its use k − S is consumed."""
        a_rows, w_rows, a_ok, w_ok = _copy_pointers(a_ptr, w_ptr, M, N, off_t, off_w, stride_a,
                                                    stride_w, BT, BW, BK)  # fmt: skip
        for k in range(steps):
            _issue(a_rows, w_rows, a_ok, w_ok, a_smem, w8_smem, ready, mma_done, k, BK, S)

    @gluon.jit
    def _decode(w8_smem, ready, s_rows, k, S: gl.constexpr, E8M0: gl.constexpr,
                W_L: gl.constexpr):  # fmt: skip
        """Step k's weight codes × their rows' block scale → bf16 (exact), in wgmma's A layout."""
        sc = _scale(s_rows, k, E8M0)
        s = k % S
        mbarrier.wait(ready.index(s), (k // S) & 1)
        codes = w8_smem.index(s).load(W_L)
        return (codes.to(gl.float32) * sc[:, None]).to(gl.bfloat16)

    @gluon.jit
    def _step(acc, w, a_smem, k, S: gl.constexpr):
        """Step k's wgmma, asynchronous: the decoded weight (registers) times the activation."""
        fence_async_shared()
        return warpgroup_mma(w, a_smem.index(k % S).permute((1, 0)), acc, is_async=True)

    @gluon.jit
    def _release(mma_done, k, S: gl.constexpr):
        """Step k's wgmma has completed in both warpgroups: its stage is free."""
        _cta_barrier()
        mbarrier.arrive(mma_done.index(k % S), count=1)

    @gluon.jit
    def _mma(out_ptr, scale_ptr, a_smem, w8_smem, ready, mma_done, M, N, off_t, off_w, steps,
             stride_s, stride_o, BT: gl.constexpr, BW: gl.constexpr, S: gl.constexpr,
             E8M0: gl.constexpr, WARPS: gl.constexpr):  # fmt: skip
        """The accumulator over every step, then its store, transposed."""
        ACC: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BT, 16]
        )
        W_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        rows = off_w + gl.arange(0, BW, layout=gl.SliceLayout(1, W_L))
        s_rows = scale_ptr + (gl.minimum(rows, N - 1) // 32).to(gl.int64) * stride_s
        acc = gl.zeros([BW, BT], gl.float32, layout=ACC)
        # two register sets in turn: a step's decode writes the set whose wgmma has completed
        # (one set rewritten under an in-flight wgmma makes ptxas serialize every wgmma)
        wa = _decode(w8_smem, ready, s_rows, 0, S, E8M0, W_L)
        wb = wa
        for j in range(steps // 2):
            k = 2 * j
            acc = _step(acc, wa, a_smem, k, S)
            acc, wb = warpgroup_mma_wait(num_outstanding=1, deps=[acc, wb])  # k − 1 completed
            if k > 0:
                _release(mma_done, k - 1, S)
            wb = _decode(w8_smem, ready, s_rows, k + 1, S, E8M0, W_L)
            acc = _step(acc, wb, a_smem, k + 1, S)
            acc, wa = warpgroup_mma_wait(num_outstanding=1, deps=[acc, wa])  # k completed
            _release(mma_done, k, S)
            wa = _decode(w8_smem, ready, s_rows, gl.minimum(k + 2, steps - 1), S, E8M0, W_L)
        if steps % 2:
            acc = _step(acc, wa, a_smem, steps - 1, S)
            acc, wb = warpgroup_mma_wait(num_outstanding=1, deps=[acc, wb])
        acc, wa, wb = warpgroup_mma_wait(num_outstanding=0, deps=[acc, wa, wb])
        # outᵀ → out: threads along the weight rows, which are out's contiguous columns
        ST: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, WARPS], [0, 1])
        res = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), ST)
        cols = off_w + gl.arange(0, BW, layout=gl.SliceLayout(1, ST))
        toks = off_t + gl.arange(0, BT, layout=gl.SliceLayout(0, ST))
        ok = (cols < N)[:, None] & (toks < M)[None, :]
        out = out_ptr + toks.to(gl.int64)[None, :] * stride_o + cols[:, None]
        gl.store(out, res, mask=ok)

    @gluon.jit
    def _fp8_gemm_regs_kernel(
        a_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, stride_a, stride_w, stride_s, stride_o,
        BT: gl.constexpr, BW: gl.constexpr, BK: gl.constexpr, S: gl.constexpr,
        E8M0: gl.constexpr, WARPS: gl.constexpr, LOAD_REGS: gl.constexpr,
    ):  # fmt: skip
        num_t = gl.cdiv(M, BT)
        pid = gl.program_id(0)
        off_t = (pid % num_t) * BT
        off_w = (pid // num_t) * BW
        steps = K // BK
        A_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BK], gl.bfloat16)
        W8_SL: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=2,
                                                      order=[1, 0])  # fmt: skip
        a_smem = gl.allocate_shared_memory(gl.bfloat16, [S, BT, BK], A_SL)
        w8_smem = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [S, BW, BK], W8_SL)
        ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        mma_done = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(S):
            mbarrier.init(ready.index(i), count=128)  # the loader's 128 threads' copies
            mbarrier.init(mma_done.index(i), count=1)
        gl.warp_specialize(
            [(_mma, (out_ptr, scale_ptr, a_smem, w8_smem, ready, mma_done, M, N, off_t, off_w,
                     steps, stride_s, stride_o, BT, BW, S, E8M0, WARPS)),
             (_loader, (a_ptr, w_ptr, a_smem, w8_smem, ready, mma_done, M, N, off_t, off_w,
                        steps, stride_a, stride_w, BT, BW, BK, S))],
            [4], [LOAD_REGS])  # fmt: skip


def _constexprs(e8m0: bool) -> dict[str, int]:
    return dict(BT=BT, BW=BW, BK=BK, S=STAGES, E8M0=int(e8m0), WARPS=MMA_WARPS,
                LOAD_REGS=LOAD_REGS)  # fmt: skip


def fp8_gemm_gluon_regs(a: Tensor, w: Tensor, w_scale: Tensor, *,
                        out_dtype: torch.dtype | None = None) -> Tensor:  # fmt: skip
    """a [M, K] bf16 (an exact quantized activation) · (w [N, K] e4m3 × its 32×32 block scales)ᵀ
    → [M, N] in out_dtype (default a's), on a Hopper GPU."""
    a, w, s, e8m0 = gemm_operands(a, w, w_scale, "fp8_gemm_gluon_regs")
    (m, k), n = a.shape, w.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or a.dtype, device=a.device)
    if m and n:
        grid = (-(-m // BT) * -(-n // BW),)
        _fp8_gemm_regs_kernel[grid](a, w, s, out, m, n, k, a.stride(0), w.stride(0),
                                    s.stride(0), out.stride(0), num_warps=MMA_WARPS,
                                    maxnreg=MAXNREG, **_constexprs(e8m0))  # fmt: skip
    return out


def compile_fp8_gemm_regs_for_sm90(e8m0: bool = True) -> object:
    """The kernel compiled for sm_90 without a GPU (tests: it compiles, its registers and shared
    memory, the wgmma shape)."""
    types = ["*bf16", "*fp8e4nv", "*u8" if e8m0 else "*fp32", "*bf16"] + ["i32"] * 7
    return compile_sm90(
        _fp8_gemm_regs_kernel, types, dict(num_warps=MMA_WARPS, maxnreg=MAXNREG),
        _constexprs(e8m0),
    )  # fmt: skip
