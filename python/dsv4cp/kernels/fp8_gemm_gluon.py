"""A warp-specialised Gluon GEMM for Hopper (sm_90) that multiplies bf16 activations by an fp8
weight with 32×32 block scales without writing the weight's bf16 copy to HBM: out = a · deq(w)ᵀ,
the same exact products as `kernels.fp8_linear.dequant_mm` (its operand `a` is the activation
already quantized, `quantized_act_bf16`), fp32 accumulation in the tensor cores' order.

Why (docs/performance.md §17, §20, §32–§35): the cuBLAS route dequantizes the whole weight per
call, a fixed cost per layer that every CP rank repeats. The kernel computes outᵀ tiles =
deq(w) · aᵀ, so the weight is wgmma's A operand, which Hopper reads from registers: the decoded
weight never touches shared memory (§35: a first version decoded into a shared-memory tile on
its own warps, ~80 KiB of shared-memory traffic a K step against ~56 KiB here, and ran at half
this one's rate; it was removed).

- loader (4 warps): cp.async of the weight codes [BW, 32] (e4m3) and the activation tile [BT, 32]
  (bf16) of each K step into stage (step % S), each thread's copies arriving on ready[stage]
  (count 128, no increment), once the stage's use S steps earlier is consumed (mma_done);
- MMA (the default partition, 2 warpgroups, each 64 of the BW weight rows): per step the
  asynchronous wgmma of the decoded weight (registers) and the activation tile (shared memory)
  into the fp32 [BW, BT] accumulator; meanwhile the next step's codes are loaded in wgmma's A
  register layout, times their row block's scale, rounded to bf16 (exact). One wgmma stays in
  flight. Two register sets alternate, a set rewritten only after the wait that retired its
  wgmma (with one loop-carried set ptxas serializes every wgmma: the compile test checks).
  Every second step one partition barrier frees the two steps' stages.
The epilogue writes the accumulator transposed through a layout whose threads run along `out`'s
rows. Programs run in groups of `group_width` weight tiles × every token tile (1 while the
activation stays in L2: token tile fastest, each weight tile read once). Needs K % 32 == 0 (every
Flash projection). Twin: `ops.linear.dequant_fp8_blocks` + torch.mm (same products; summation
order differs within the bound tests/gpu/test_fp8_gemm_gluon_gpu.py checks). Routed by
`kernels.fp8_linear` under `DSV4CP_FP8_GEMM=gluon` only; `benchmarks/fp8_gemm_gluon.py` measures
it against the cuBLAS route.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4cp.kernels._gluon import HAVE_GLUON, compile_sm90
from dsv4cp.ops.linear import WEIGHT_BLOCK, check_fp8_blocks

BW = 128  # weight rows (output columns) per program: two warpgroups of 64, wgmma's M
BT = 256  # activation rows (tokens) per program: wgmma's N
BK = 32  # K per step: one scale column
STAGES = 6  # 6 × (16 + 4) KiB of shared memory
MMA_WARPS = 8
# registers a thread: the launch's limit for 12 warps; the loader gets LOAD_REGS, the MMA
# warpgroups (3·168 − LOAD_REGS) / 2 = 216 (the fp32 accumulator alone is 128)
MAXNREG = 168
LOAD_REGS = 72
L2_ACT_BYTES = 24 << 20  # an activation up to this stays in L2 across the weight tiles
L2_WEIGHT_BYTES = 16 << 20  # weight codes a program group keeps in L2

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
    def _loader(a_ptr, w_ptr, a_smem, w8_smem, ready, mma_done, M, N, off_t, off_w, steps,
                stride_a, stride_w, BT: gl.constexpr, BW: gl.constexpr, BK: gl.constexpr,
                S: gl.constexpr):  # fmt: skip
        """Step k's two tiles by cp.async into stage k % S once its use k − S is consumed; each
        thread's copies arrive on ready[stage] when they land (count 128, no increment)."""
        LA: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])  # 16 B of bf16
        LW: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0])  # 16 B of e4m3
        ra = off_t + gl.arange(0, BT, layout=gl.SliceLayout(1, LA))
        ca = gl.arange(0, BK, layout=gl.SliceLayout(0, LA))
        rw = off_w + gl.arange(0, BW, layout=gl.SliceLayout(1, LW))
        cw = gl.arange(0, BK, layout=gl.SliceLayout(0, LW))
        # a 64-bit address a copy: int32 offsets from one base were 8–12 % slower (§35)
        a_rows = a_ptr + ra.to(gl.int64)[:, None] * stride_a + ca[None, :]
        w_rows = w_ptr + rw.to(gl.int64)[:, None] * stride_w + cw[None, :]
        a_ok = (ra < M)[:, None] & (ca < BK)[None, :]
        w_ok = (rw < N)[:, None] & (cw < BK)[None, :]
        for k in range(steps):
            s = k % S
            mbarrier.wait(mma_done.index(s), ((k // S) & 1) ^ 1)  # use k − S consumed, or none
            async_copy.async_copy_global_to_shared(a_smem.index(s), a_rows + k * BK, mask=a_ok)
            async_copy.async_copy_global_to_shared(w8_smem.index(s), w_rows + k * BK, mask=w_ok)
            async_copy.mbarrier_arrive(ready.index(s), increment_count=False)

    @gluon.jit
    def _decode(w8_smem, ready, s_rows, k, S: gl.constexpr, E8M0: gl.constexpr,
                W_L: gl.constexpr):  # fmt: skip
        """Step k's weight codes × their rows' block scale → bf16 (exact), in wgmma's A layout.
        (Loading the scales two steps earlier was slower: §35.)"""
        if E8M0:  # the byte b → 2^(b − 127) as ops.quant.e8m0_to_float
            b = gl.load(s_rows + k).to(gl.int32)
            sc = (b << 23).to(gl.float32, bitcast=True)
            sc = gl.where(b == 0, 2.0**-127, sc)
            sc = gl.where(b == 255, float("nan"), sc)
        else:
            sc = gl.load(s_rows + k)
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
    def _release_pair(mma_done, k, S: gl.constexpr):
        """Steps k − 1 (if any) and k have completed in both warpgroups: their stages are free."""
        _cta_barrier()
        if k > 0:
            mbarrier.arrive(mma_done.index((k - 1) % S), count=1)
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
        wa = _decode(w8_smem, ready, s_rows, 0, S, E8M0, W_L)
        wb = wa
        for j in range(steps // 2):
            k = 2 * j
            acc = _step(acc, wa, a_smem, k, S)
            acc, wb = warpgroup_mma_wait(num_outstanding=1, deps=[acc, wb])  # k − 1 completed
            wb = _decode(w8_smem, ready, s_rows, k + 1, S, E8M0, W_L)
            acc = _step(acc, wb, a_smem, k + 1, S)
            acc, wa = warpgroup_mma_wait(num_outstanding=1, deps=[acc, wa])  # k completed
            _release_pair(mma_done, k, S)
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
    def _fp8_gemm_kernel(
        a_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, stride_a, stride_w, stride_s, stride_o,
        group_w, BT: gl.constexpr, BW: gl.constexpr, BK: gl.constexpr, S: gl.constexpr,
        E8M0: gl.constexpr, WARPS: gl.constexpr, LOAD_REGS: gl.constexpr,
    ):  # fmt: skip
        # programs in groups of group_w weight tiles × every token tile, weight tile fastest
        # within a group (group_w = 1: token tile fastest, each weight tile read once)
        num_t = gl.cdiv(M, BT)
        pid = gl.program_id(0)
        first_w = (pid // (group_w * num_t)) * group_w
        in_group = pid % (group_w * num_t)
        width = gl.minimum(gl.cdiv(N, BW) - first_w, group_w)
        off_w = (first_w + in_group % width) * BW
        off_t = (in_group // width) * BT
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


def group_width(m: int, n: int, k: int) -> int:
    """Weight tiles per program group: 1 (token tile fastest) while the bf16 activation fits in
    L2_ACT_BYTES, else as many as fill L2_WEIGHT_BYTES, so a large activation is read from HBM
    ⌈N / (BW · width)⌉ times instead of N / BW times (§35: 1.2–1.7× faster at 16,384 rows)."""
    if m * k * 2 <= L2_ACT_BYTES:
        return 1
    return max(1, min(-(-n // BW), L2_WEIGHT_BYTES // (BW * k)))


def require_hopper(t: Tensor) -> None:
    """Refuse, by name, a tensor that is not on a Hopper GPU (sm_90) or a Triton without Gluon."""
    if not HAVE_GLUON:
        raise RuntimeError("fp8_gemm_gluon: this Triton has no Gluon")
    if not t.is_cuda or torch.cuda.get_device_capability(t.device) != (9, 0):
        name = torch.cuda.get_device_name(t.device) if t.is_cuda else str(t.device)
        raise RuntimeError(f"fp8_gemm_gluon: needs a Hopper GPU (sm_90), got {name}")


def fp8_gemm_gluon(a: Tensor, w: Tensor, w_scale: Tensor, *, out_dtype: torch.dtype | None = None,
                   group: int | None = None) -> Tensor:  # fmt: skip
    """a [M, K] bf16 (an exact quantized activation) · (w [N, K] e4m3 × its 32×32 block scales)ᵀ
    → [M, N] in out_dtype (default a's), on a Hopper GPU. `group`: weight tiles per program group
    (default `group_width`'s; the benchmark times 1 against it)."""
    n, k = check_fp8_blocks(w, w_scale, WEIGHT_BLOCK, "fp8_gemm_gluon")
    if a.dim() != 2 or a.shape[1] != k or a.dtype != torch.bfloat16 or not a.is_cuda:
        raise ValueError(f"fp8_gemm_gluon: a must be CUDA bf16 [M, {k}], got "
                         f"{a.dtype} {tuple(a.shape)}")  # fmt: skip
    if k % BK:
        raise ValueError(f"fp8_gemm_gluon: K must be a multiple of {BK}, got {k}")
    if group is not None and group < 1:
        raise ValueError(f"fp8_gemm_gluon: group must be ≥ 1, got {group}")
    require_hopper(a)
    a = a if a.stride(1) == 1 and a.stride(0) % 8 == 0 else a.contiguous()
    w = w if w.stride(1) == 1 and w.stride(0) % 16 == 0 else w.contiguous()
    e8m0 = w_scale.dtype in (torch.float8_e8m0fnu, torch.uint8)
    s = (w_scale.view(torch.uint8) if e8m0 else w_scale.float()).contiguous()
    m = a.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or a.dtype, device=a.device)
    if m and n:
        grid = (-(-m // BT) * -(-n // BW),)
        _fp8_gemm_kernel[grid](a, w, s, out, m, n, k, a.stride(0), w.stride(0), s.stride(0),
                               out.stride(0), group or group_width(m, n, k), num_warps=MMA_WARPS,
                               maxnreg=MAXNREG, **_constexprs(e8m0))  # fmt: skip
    return out


def compile_fp8_gemm_for_sm90(e8m0: bool = True) -> object:
    """The kernel compiled for sm_90 without a GPU (tests: it compiles, its registers and shared
    memory, the wgmma shape)."""
    types = ["*bf16", "*fp8e4nv", "*u8" if e8m0 else "*fp32", "*bf16"] + ["i32"] * 8
    return compile_sm90(
        _fp8_gemm_kernel, types, dict(num_warps=MMA_WARPS, maxnreg=MAXNREG), _constexprs(e8m0)
    )
