"""A warp-specialised Gluon GEMM for Hopper (sm_90) that multiplies bf16 activations by an fp8
weight with 32×32 block scales without writing the weight's bf16 copy to HBM: out = a · deq(w)ᵀ,
the same exact products as `kernels.fp8_linear.dequant_mm` (its operand `a` is the activation
already quantized, `quantized_act_bf16`), fp32 accumulation in the tensor cores' order.

Why (docs/performance.md §17, §20, §32): the cuBLAS route dequantizes the whole weight per call,
a fixed ~0.1 ms per SWA layer that every CP rank repeats. §17's fused Triton kernel decoded the
weight tile on the warps that issue the MMAs, from registers, and ran at half cuBLAS's rate.
Here the decode has its own warps and the tensor cores read both operands from shared memory:

- feeder (4 warps): cp.async of the activation tile [BM, 32] (bf16) and the weight tile
  [BN, 32] (e4m3 codes) of each K step into stage (step % S), AHEAD steps ahead, each thread's
  copies arriving on ready[stage] (count 128, no increment); then, step by step, the codes times
  their row block's scale (a step of 32 columns is one scale column) rounded to bf16 (exact)
  into the stage's bf16 weight tile, announced on conv[stage]. (A separate converter partition
  would need 16 warps, too few registers for the MMA warpgroups' wgmma.);
- MMA (the default partition, 8 warps = 2 warpgroups, each 64 of the BM rows): per step one
  asynchronous wgmma of the activation tile and the bf16 weight tile into the fp32 [BM, BN]
  accumulator; once step k − 1's wgmma has completed, mma_done[stage of k − 1] frees that stage
  for the feeder. The epilogue stores the accumulator as `out`'s dtype.

One output tile per program, programs ordered M-fastest so consecutive programs share a weight
tile through L2. Needs K % 32 == 0 (every Flash projection). Twin:
`ops.linear.dequant_fp8_blocks` + torch.mm (same products; summation order differs within the
bound tests/gpu/test_fp8_gemm_gluon_gpu.py checks). Routed by `kernels.fp8_linear` under
`DSV4CP_FP8_GEMM=gluon` only; `benchmarks/fp8_gemm_gluon.py` measures it against the cuBLAS route.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4cp.kernels._gluon import HAVE_GLUON, compile_sm90
from dsv4cp.ops.linear import WEIGHT_BLOCK, check_fp8_blocks

BM = 128  # activation rows per program (two warpgroups of 64)
BN = 256  # weight rows (output columns) per program
BK = 32  # K per step: one scale column
STAGES = 6  # 6 × (8 + 8 + 16) KiB of shared memory
MMA_WARPS = 8
# registers a thread: the launch's limit for 12 warps, then what `setmaxnreg` gives the feeder
# (104 spills once the next step's scales are prefetched); the MMA warpgroups get the rest,
# (3·168 − 120) / 2 = 192 (the fp32 accumulator alone is 128;
# ptxas needs ≥ 154 at the wgmma, so loads and conversion share one 4-warp partition)
MAXNREG = 168
FEED_REGS = 120
AHEAD = STAGES - 2  # K steps the copies run ahead of the conversion (≤ STAGES − 1)

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from dsv4cp.kernels._gluon import cta_barrier as _cta_barrier

    @gluon.jit
    def _copy_pointers(a_ptr, w_ptr, M, N, off_a, off_w, stride_a, stride_w,
                       A_ROWS: gl.constexpr, W_ROWS: gl.constexpr,
                       BK: gl.constexpr):  # fmt: skip
        """Step 0's source addresses and masks of the activation tile [A_ROWS, BK] (bf16) and
        the weight-code tile [W_ROWS, BK] (e4m3), 16 B a thread a copy (4 warps)."""
        LA: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])  # 16 B of bf16
        LW: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0])  # 16 B of e4m3
        ra = off_a + gl.arange(0, A_ROWS, layout=gl.SliceLayout(1, LA))
        ca = gl.arange(0, BK, layout=gl.SliceLayout(0, LA))
        rw = off_w + gl.arange(0, W_ROWS, layout=gl.SliceLayout(1, LW))
        cw = gl.arange(0, BK, layout=gl.SliceLayout(0, LW))
        a_rows = a_ptr + ra.to(gl.int64)[:, None] * stride_a + ca[None, :]
        w_rows = w_ptr + rw.to(gl.int64)[:, None] * stride_w + cw[None, :]
        a_ok = (ra < M)[:, None] & (ca < BK)[None, :]
        w_ok = (rw < N)[:, None] & (cw < BK)[None, :]
        return a_rows, w_rows, a_ok, w_ok

    @gluon.jit
    def _issue(a_rows, w_rows, a_ok, w_ok, a_smem, w8_smem, ready, mma_done, k,
               BK: gl.constexpr, S: gl.constexpr):  # fmt: skip
        """Step k's two tiles by cp.async into stage k % S once its use k − S is consumed; each
        thread's copies arrive on ready[stage] when they land (count 128, no increment)."""
        s = k % S
        mbarrier.wait(mma_done.index(s), ((k // S) & 1) ^ 1)  # use k − S consumed, or none
        async_copy.async_copy_global_to_shared(a_smem.index(s), a_rows + k * BK, mask=a_ok)
        async_copy.async_copy_global_to_shared(w8_smem.index(s), w_rows + k * BK, mask=w_ok)
        async_copy.mbarrier_arrive(ready.index(s), increment_count=False)

    @gluon.jit
    def _scale(s_rows, k, E8M0: gl.constexpr):
        """Step k's block scale of each weight row, fp32."""
        if E8M0:  # the byte b → 2^(b − 127) as ops.quant.e8m0_to_float
            b = gl.load(s_rows + k).to(gl.int32)
            sc = (b << 23).to(gl.float32, bitcast=True)
            sc = gl.where(b == 0, 2.0**-127, sc)
            sc = gl.where(b == 255, float("nan"), sc)
        else:
            sc = gl.load(s_rows + k)
        return sc

    @gluon.jit
    def _feeder(a_ptr, w_ptr, scale_ptr, a_smem, w8_smem, wb_smem, ready, conv, mma_done, M,
                N, off_m, off_n, steps, stride_a, stride_w, stride_s, BM: gl.constexpr,
                BN: gl.constexpr, BK: gl.constexpr, S: gl.constexpr, E8M0: gl.constexpr,
                AHEAD: gl.constexpr):  # fmt: skip
        """Copies run AHEAD (≤ S − 1) steps ahead of the conversion: step k's codes × their
        rows' block scale → bf16 (exact) into wb_smem[k % S], announced on conv once the
        stage's activation tile has landed too. The stage's use k − S was consumed before step
        k's copies were issued. The next step's scales are loaded while this step converts."""
        LC: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        a_rows, w_rows, a_ok, w_ok = _copy_pointers(a_ptr, w_ptr, M, N, off_m, off_n, stride_a,
                                                    stride_w, BM, BN, BK)  # fmt: skip
        rows = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, LC))
        s_rows = scale_ptr + (gl.minimum(rows, N - 1) // 32).to(gl.int64) * stride_s
        for k in range(gl.minimum(steps, AHEAD)):
            _issue(a_rows, w_rows, a_ok, w_ok, a_smem, w8_smem, ready, mma_done, k, BK, S)
        sc_next = _scale(s_rows, 0, E8M0)
        for k in range(steps):
            s = k % S
            sc = sc_next
            sc_next = _scale(s_rows, gl.minimum(k + 1, steps - 1), E8M0)
            mbarrier.wait(ready.index(s), (k // S) & 1)
            codes = w8_smem.index(s).load(LC)
            vals = (codes.to(gl.float32) * sc[:, None]).to(gl.bfloat16)
            wb_smem.index(s).store(vals)
            fence_async_shared()
            _cta_barrier()  # every feeder thread's stores and landed copies, then one arrive
            mbarrier.arrive(conv.index(s), count=1)
            # after step k's conversion, not before: the MMA frees step k − 1's stage only
            # once it has step k's tile, so AHEAD = S − 1 runs the two in lock step and
            # AHEAD = S − 2 lets the conversion run up to two steps ahead of the MMA
            if k + AHEAD < steps:
                _issue(a_rows, w_rows, a_ok, w_ok, a_smem, w8_smem, ready, mma_done,
                       k + AHEAD, BK, S)  # fmt: skip

    @gluon.jit
    def _mma(out_ptr, a_smem, wb_smem, conv, mma_done, M, N, off_m, off_n, steps,
             stride_o, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
             S: gl.constexpr, WARPS: gl.constexpr):  # fmt: skip
        """The accumulator over every step, then its store."""
        ACC: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BN, 16]
        )
        acc = gl.zeros([BM, BN], gl.float32, layout=ACC)
        for k in range(steps):
            s = k % S
            ph = (k // S) & 1
            mbarrier.wait(conv.index(s), ph)  # the feeder saw the stage's copies land
            fence_async_shared()
            acc = warpgroup_mma(a_smem.index(s), wb_smem.index(s).permute((1, 0)), acc,
                                is_async=True)  # fmt: skip
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
            if k > 0:  # step k − 1's wgmma has completed in both warpgroups
                _cta_barrier()
                mbarrier.arrive(mma_done.index((k - 1) % S), count=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, ACC))
        cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, ACC))
        ok = (rows < M)[:, None] & (cols < N)[None, :]
        out = out_ptr + rows.to(gl.int64)[:, None] * stride_o + cols[None, :]
        gl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok)

    @gluon.jit
    def _fp8_gemm_kernel(
        a_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, stride_a, stride_w, stride_s, stride_o,
        BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, S: gl.constexpr,
        E8M0: gl.constexpr, WARPS: gl.constexpr, FEED_REGS: gl.constexpr, AHEAD: gl.constexpr,
    ):  # fmt: skip
        num_m = gl.cdiv(M, BM)
        pid = gl.program_id(0)
        off_m = (pid % num_m) * BM
        off_n = (pid // num_m) * BN
        steps = K // BK
        A_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
        W_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
        W8_SL: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=2,
                                                      order=[1, 0])  # fmt: skip
        a_smem = gl.allocate_shared_memory(gl.bfloat16, [S, BM, BK], A_SL)
        w8_smem = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [S, BN, BK], W8_SL)
        wb_smem = gl.allocate_shared_memory(gl.bfloat16, [S, BN, BK], W_SL)
        ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        conv = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        mma_done = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(S):
            mbarrier.init(ready.index(i), count=128)  # the feeder's 128 threads' copies
            mbarrier.init(conv.index(i), count=1)
            mbarrier.init(mma_done.index(i), count=1)
        gl.warp_specialize(
            [(_mma, (out_ptr, a_smem, wb_smem, conv, mma_done, M, N, off_m, off_n, steps,
                     stride_o, BM, BN, BK, S, WARPS)),
             (_feeder, (a_ptr, w_ptr, scale_ptr, a_smem, w8_smem, wb_smem, ready, conv,
                        mma_done, M, N, off_m, off_n, steps, stride_a, stride_w, stride_s, BM,
                        BN, BK, S, E8M0, AHEAD))],
            [4], [FEED_REGS])  # fmt: skip


def _constexprs(e8m0: bool) -> dict[str, int]:
    return dict(BM=BM, BN=BN, BK=BK, S=STAGES, E8M0=int(e8m0), WARPS=MMA_WARPS,
                FEED_REGS=FEED_REGS, AHEAD=AHEAD)  # fmt: skip


def require_hopper(t: Tensor) -> None:
    """Refuse, by name, a tensor that is not on a Hopper GPU (sm_90) or a Triton without Gluon."""
    if not HAVE_GLUON:
        raise RuntimeError("fp8_gemm_gluon: this Triton has no Gluon")
    if not t.is_cuda or torch.cuda.get_device_capability(t.device) != (9, 0):
        name = torch.cuda.get_device_name(t.device) if t.is_cuda else str(t.device)
        raise RuntimeError(f"fp8_gemm_gluon: needs a Hopper GPU (sm_90), got {name}")


def gemm_operands(a: Tensor, w: Tensor, w_scale: Tensor, name: str
                  ) -> tuple[Tensor, Tensor, Tensor, bool]:  # fmt: skip
    """Check a Gluon fp8-weight GEMM's operands (by `name`) and lay them out for its copies:
    (a, w, the scales as bytes or fp32, whether they are e8m0 bytes)."""
    _, k = check_fp8_blocks(w, w_scale, WEIGHT_BLOCK, name)
    if a.dim() != 2 or a.shape[1] != k or a.dtype != torch.bfloat16 or not a.is_cuda:
        raise ValueError(f"{name}: a must be CUDA bf16 [M, {k}], got {a.dtype} {tuple(a.shape)}")
    if k % BK:
        raise ValueError(f"{name}: K must be a multiple of {BK}, got {k}")
    require_hopper(a)
    a = a if a.stride(1) == 1 and a.stride(0) % 8 == 0 else a.contiguous()
    w = w if w.stride(1) == 1 and w.stride(0) % 16 == 0 else w.contiguous()
    e8m0 = w_scale.dtype in (torch.float8_e8m0fnu, torch.uint8)
    s = (w_scale.view(torch.uint8) if e8m0 else w_scale.float()).contiguous()
    return a, w, s, e8m0


def fp8_gemm_gluon(a: Tensor, w: Tensor, w_scale: Tensor, *, out_dtype: torch.dtype | None = None
                   ) -> Tensor:  # fmt: skip
    """a [M, K] bf16 (an exact quantized activation) · (w [N, K] e4m3 × its 32×32 block scales)ᵀ
    → [M, N] in out_dtype (default a's), on a Hopper GPU."""
    a, w, s, e8m0 = gemm_operands(a, w, w_scale, "fp8_gemm_gluon")
    (m, k), n = a.shape, w.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or a.dtype, device=a.device)
    if m and n:
        grid = (-(-m // BM) * -(-n // BN),)
        _fp8_gemm_kernel[grid](a, w, s, out, m, n, k, a.stride(0), w.stride(0), s.stride(0),
                               out.stride(0), num_warps=MMA_WARPS, maxnreg=MAXNREG,
                               **_constexprs(e8m0))  # fmt: skip
    return out


def compile_fp8_gemm_for_sm90(e8m0: bool = True) -> object:
    """The kernel compiled for sm_90 without a GPU (tests: it compiles, its partitions' registers
    and shared memory)."""
    types = ["*bf16", "*fp8e4nv", "*u8" if e8m0 else "*fp32", "*bf16"] + ["i32"] * 7
    return compile_sm90(
        _fp8_gemm_kernel, types, dict(num_warps=MMA_WARPS, maxnreg=MAXNREG), _constexprs(e8m0)
    )
