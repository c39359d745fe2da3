"""The half-buffer Gluon sparse attention for Hopper (sm_90): FlashMLA's sm_90 sparse-prefill
schedule (deepseek-ai/FlashMLA, csrc/sm90/prefill/sparse, read, not copied) written in Gluon
over this package's interface — one query per program, 64 heads × 512, three warpgroups: two
math warpgroups (`attention_gluon_halves_math.math_partition`, whose docstring gives their
schedule and math) and the loader. This file holds the loader, the kernel (shared memory,
barriers, partitions) and the host launch:

- 64-key tiles in two kv buffers: round r's tile A = 2r in buffer 0 (math warpgroup 0's), tile
  B = 2r + 1 in buffer 1 (warpgroup 1's). Each buffer is loaded and freed in halves (columns
  0–255 "L", 256–511 "R"), each half with its own ready and free barrier, in the order the
  math side frees them: A_L, B_R, A_R, B_L;
- the query arrives by the loader's cp.async copies counted on `q_ready` (128 non-incrementing
  arrives, no wait_group).
  docs/performance.md §30: with this, the math warpgroups' staged output and warpgroup 1's
  FlashMLA order, 0.893 of FlashMLA's speed against 0.743 before.
"""

from __future__ import annotations

from torch import Tensor

from dsv4cp.kernels.attention_gluon import HAVE_GLUON, compile_for_sm90, launch_per_query

# Registers a thread: the launch's limit, then what `setmaxnreg` gives the second math
# warpgroup and the loader; the first math warpgroup, Gluon's default partition, gets the rest,
# 3·168 − 216 − 40 = 248 (check_regs). Triton 3.6 sm_90 (ptxas): no partition spills in its loop
# at this grant; at 232 / 40 the first math warpgroup spilled 72 B (docs/performance.md §28).
MAXNREG = 168
MATH_REGS = 216
LOAD_REGS = 40
BLOCK_N = 64  # keys per tile

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import async_copy, mbarrier

    from dsv4cp.kernels.attention_gluon import _copy_query
    from dsv4cp.kernels.attention_gluon_halves_math import A_L, A_R, B_L, B_R, math_partition

    @gluon.jit
    def _load_query_counted(q_row, q_smem, q_ready, stride_qh, H: gl.constexpr,
                            D: gl.constexpr, LD: gl.constexpr):  # fmt: skip
        """The query by cp.async; each loader thread's copies arrive on `q_ready` (count 128)."""
        _copy_query(q_row, q_smem, stride_qh, H, D, LD)
        async_copy.mbarrier_arrive(q_ready, increment_count=False)

    @gluon.jit
    def _copy_half(kv_ptr, idx, buf, col0, N, stride_kvn, HALF: gl.constexpr, LD: gl.constexpr):
        """cp.async of one tile half's gathered rows (−1 and out-of-range rows zero-filled)."""
        ok = (idx >= 0) & (idx < N)
        cols = col0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, LD))
        ptrs = kv_ptr + idx.to(gl.int64)[:, None] * stride_kvn + cols[None, :]
        async_copy.async_copy_global_to_shared(buf, ptrs, mask=ok[:, None])

    @gluon.jit
    def _loader(q_row, kv_ptr, idx_row, q_smem, kv_smem, ready, free, q_ready, N, K, stride_qh,
                stride_kvn, H: gl.constexpr, D: gl.constexpr, BN: gl.constexpr):  # fmt: skip
        """The query, then each round's four halves, each announced on its ready barrier when
        the loader's 128 threads' copies land (.noinc); round r is phase r & 1."""
        HALF: gl.constexpr = D // 2
        QL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        _load_query_counted(q_row, q_smem, q_ready, stride_qh, H, D, QL)
        # 8 threads a row (128 B each), 4 rows a warp: 4 indices a thread
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rows = gl.arange(0, BN, layout=gl.SliceLayout(1, LD))
        n_tiles = gl.cdiv(K, BN)
        for r in range(gl.cdiv(n_tiles, 2)):
            ph = (r & 1) ^ 1  # the previous round's use freed, or none
            offs_a = 2 * r * BN + rows
            idx_a = gl.load(idx_row + offs_a, mask=offs_a < K, other=-1)
            offs_b = offs_a + BN
            idx_b = gl.load(idx_row + offs_b, mask=offs_b < K, other=-1)
            has_b = 2 * r + 1 < n_tiles
            buf_a = kv_smem.index(0)
            buf_b = kv_smem.index(1)
            mbarrier.wait(free.index(A_L), ph)
            _copy_half(kv_ptr, idx_a, buf_a.slice(0, HALF, dim=1), 0, N, stride_kvn, HALF, LD)
            async_copy.mbarrier_arrive(ready.index(A_L), increment_count=False)
            if has_b:
                mbarrier.wait(free.index(B_R), ph)
                _copy_half(kv_ptr, idx_b, buf_b.slice(HALF, HALF, dim=1), HALF, N, stride_kvn,
                           HALF, LD)  # fmt: skip
                async_copy.mbarrier_arrive(ready.index(B_R), increment_count=False)
            mbarrier.wait(free.index(A_R), ph)
            _copy_half(kv_ptr, idx_a, buf_a.slice(HALF, HALF, dim=1), HALF, N, stride_kvn, HALF,
                       LD)  # fmt: skip
            async_copy.mbarrier_arrive(ready.index(A_R), increment_count=False)
            if has_b:
                mbarrier.wait(free.index(B_L), ph)
                _copy_half(kv_ptr, idx_b, buf_b.slice(0, HALF, dim=1), 0, N, stride_kvn, HALF,
                           LD)  # fmt: skip
                async_copy.mbarrier_arrive(ready.index(B_L), increment_count=False)

    @gluon.jit
    def _partition(ROLE: gl.constexpr, q_row, kv_ptr, sink_ptr, out_row, idx_row, q_smem, kv_smem,
                   p_smem, m_smem, l_smem, ready, free, bars, N, K, qk_scale, stride_qh,
                   stride_kvn, stride_oh, H: gl.constexpr, D: gl.constexpr,
                   BN: gl.constexpr):  # fmt: skip
        """Roles 0 and 1: the math warpgroups; role 2: the loader (one signature for all)."""
        if ROLE == 2:
            _loader(q_row, kv_ptr, idx_row, q_smem.index(0), kv_smem, ready, free, bars.index(0),
                    N, K, stride_qh, stride_kvn, H, D, BN)  # fmt: skip
        else:
            math_partition(sink_ptr, out_row, idx_row, q_smem, kv_smem, p_smem, m_smem, l_smem,
                           ready, free, bars.index(0), bars.index(1), bars.index(2),
                           bars.index(3), bars.index(4), bars.index(5), N, K, qk_scale,
                           stride_oh, ROLE, H, D, BN)  # fmt: skip

    @gluon.jit(do_not_specialize=["N", "K", "stride_it"])
    def _sparse_attention_halves_kernel(
        q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, N, K, qk_scale,
        stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh,
        H: gl.constexpr, D: gl.constexpr, BN: gl.constexpr,
        MATH_REGS: gl.constexpr,
        LOAD_REGS: gl.constexpr,
    ):  # fmt: skip
        t = gl.program_id(0).to(gl.int64)
        Q_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, D], gl.bfloat16)
        KV_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], gl.bfloat16)
        P_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, BN], gl.bfloat16)
        V_SL: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [1, H, D], Q_SL)
        kv_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, D], KV_SL)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, H, BN], P_SL)
        m_smem = gl.allocate_shared_memory(gl.float32, [2, H], V_SL)
        l_smem = gl.allocate_shared_memory(gl.float32, [2, H], V_SL)
        ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        bars = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(4):
            mbarrier.init(ready.index(i), count=128)  # the loader's 4 warps' copies land
            mbarrier.init(free.index(i), count=1)  # one math warpgroup reads each half last
        # q_ready, m_a, m_b, p_a, p_b: one arrive each; l: both warpgroups
        mbarrier.init(bars.index(0), count=128)  # q_ready: the loader's copies land
        for i in gl.static_range(1, 5):
            mbarrier.init(bars.index(i), count=1)
        mbarrier.init(bars.index(5), count=2)
        q_row = q_ptr + t * stride_qt
        idx_row = idx_ptr + t * stride_it
        out_row = out_ptr + t * stride_ot
        gl.warp_specialize(
            [
                (
                    _partition,
                    (
                        gl.constexpr(ROLE),
                        q_row,
                        kv_ptr,
                        sink_ptr,
                        out_row,
                        idx_row,
                        q_smem,
                        kv_smem,
                        p_smem,
                        m_smem,
                        l_smem,
                        ready,
                        free,
                        bars,
                        N,
                        K,
                        qk_scale,
                        stride_qh,
                        stride_kvn,
                        stride_oh,
                        H,
                        D,
                        BN,
                    ),
                )
                for ROLE in (0, 1, 2)
            ],
            [4, 4],
            [MATH_REGS, LOAD_REGS],
        )


def check_regs(math_regs: int, load_regs: int) -> int:
    """The first math warpgroup's grant (what the other two leave of 3·MAXNREG), after checking
    that each is a `setmaxnreg` value (a multiple of 8 in [24, 256])."""
    default = 3 * MAXNREG - math_regs - load_regs
    for name, n in (("math_regs", math_regs), ("load_regs", load_regs), ("the rest", default)):
        if n % 8 or not 24 <= n <= 256:
            raise ValueError(
                f"sparse_attention_gluon_halves: {name} must be a multiple of 8 in [24, 256] "
                f"(math_regs {math_regs}, load_regs {load_regs}, the rest {default} of "
                f"3 x {MAXNREG})"
            )
    return default


def sparse_attention_gluon_halves(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    sink: Tensor,
    scale: float,
    *,
    math_regs: int = MATH_REGS,
    load_regs: int = LOAD_REGS,
) -> Tensor:
    """The half-buffer Gluon twin of ops.attention.sparse_attention at the Flash shape.
    `math_regs`, `load_regs`: the second math warpgroup's and the loader's register grants (the
    first math warpgroup gets the rest: check_regs)."""
    check_regs(math_regs, load_regs)
    return launch_per_query(_sparse_attention_halves_kernel, q, kv, indices, sink, scale,
                            BN=BLOCK_N, MATH_REGS=math_regs, LOAD_REGS=load_regs, num_warps=4,
                            maxnreg=MAXNREG)  # fmt: skip


def compile_halves_for_hopper(math_regs: int = MATH_REGS, load_regs: int = LOAD_REGS) -> object:
    """The half-buffer kernel compiled for sm_90 without a GPU (tests)."""
    check_regs(math_regs, load_regs)
    return compile_for_sm90(
        _sparse_attention_halves_kernel,
        dict(num_warps=4, maxnreg=MAXNREG),
        BN=BLOCK_N,
        MATH_REGS=math_regs,
        LOAD_REGS=load_regs,
    )
