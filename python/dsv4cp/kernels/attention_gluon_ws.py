"""The warp-specialised Gluon sparse attention for Hopper (sm_90): one query per program, 64
heads × 512, three warpgroups —

- a loader (4 warps) gathers the query and then the kv tiles (BN rows each) by cp.async into
  NBUF shared buffers — (BN, NBUF) = (32, 4) by default, (64, 2) the other configuration; each
  loader thread's copies arrive on the tile's mbarrier when they land
  (cp.async.mbarrier.arrive.noinc), so the loader never waits for its own copies and up to NBUF
  tiles are in flight;
- two math warpgroups take the tiles in turn: warpgroup w computes s = q·kᵀ on tiles w, w+2, …
  (one 64×BN score tile per warpgroup, no duplicated product), the two exchange their rows'
  maxima through shared memory, each rounds its p to bf16 and publishes it, and each then
  accumulates its half of the 512 output columns over both tiles of the round: its own p from
  registers, the other's from shared memory.
A buffer is freed when both math warpgroups have finished their p·v on it. Each math warpgroup
does its own tile's p·v first (its p is in registers), then the other's (its two other orders,
timed within 4 % of this one, were removed: docs/performance.md §27). The running sums stay per
warpgroup (its own tiles' p) and are exchanged once at the end. The query's shared-memory
descriptors are indexed by a zero the compiler cannot see (`r // (n_tiles + 1)`), which keeps
them in the loop: hoisted, they spilled (108 B at (32, 4); none now, §27). The math is the Triton
kernel's (kernels/attention.py; twin ops.attention.sparse_attention): the sink starts the running
max and the running sum at e^0; −1 and out-of-range indices are masked; a row with no valid key
gives 0.
"""

from __future__ import annotations

from torch import Tensor

from dsv4cp.kernels.attention_gluon import (
    HAVE_GLUON,
    compile_for_sm90,
    launch_per_query,
)

# Registers a thread: the launch's limit, then what `setmaxnreg` gives each math warpgroup and
# the loader (the first math warpgroup, Gluon's default partition, gets the rest:
# 3·168 − 224 − 56 = 224). Triton 3.6 sm_90 compile: the loader's pointer tiles spill ~0.5 KB.
MAXNREG = 168
MATH_REGS = 224
LOAD_REGS = 56
# (keys per tile, kv buffers). (32, 4) keeps a round in flight while the last is consumed
# (206 KB of shared memory); with the copies arriving on their own barriers it led every Gluon
# and Triton kernel until the half-buffer kernel (kernels/attention_gluon_halves.py, §27).
# (64, 2): a round's two loads wait until the previous round is consumed.
WS_CONFIG = (32, 4)
WS_CONFIGS = ((64, 2), (32, 4))

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
    )

    from dsv4cp.kernels.attention_gluon import (
        _copy_query,
        _cta_barrier,
        _issue_tile,
        _normalize_half,
        _rescale,
        _sink_start,
    )

    @gluon.jit
    def _load_query(q_row, q_smem, q_ready, stride_qh, H: gl.constexpr, D: gl.constexpr,
                    LD: gl.constexpr):  # fmt: skip
        """The loader's start: the query's [H, D] rows by cp.async, then, once every loader
        thread's copies have landed, one arrive on q_ready."""
        _copy_query(q_row, q_smem, stride_qh, H, D, LD)
        async_copy.commit_group()
        async_copy.wait_group(0)
        _cta_barrier()
        fence_async_shared()
        mbarrier.arrive(q_ready, count=1)

    @gluon.jit
    def _write_half(o, l_own, l_one, l_smem, l_bar, out_row, stride_oh, WG: gl.constexpr,
                    H: gl.constexpr, HALF: gl.constexpr, ROWS: gl.constexpr,
                    O_L: gl.constexpr):  # fmt: skip
        """The kernel's end: math warpgroup WG adds the other's running sum (exchanged once
        through l_smem) to its own and the sink's, and stores its output columns
        [WG·HALF, (WG+1)·HALF) (a row with no valid key: 0)."""
        o = _normalize_half(o, l_own, l_one, l_smem, l_bar, WG, ROWS, O_L)
        heads = gl.arange(0, H, layout=gl.SliceLayout(1, O_L))
        cols = WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, O_L))
        gl.store(out_row + heads[:, None] * stride_oh + cols[None, :], o.to(gl.bfloat16))

    @gluon.jit
    def _loader(q_row, kv_ptr, idx_row, q_smem, kv_smem, ready, free, q_ready, N, K, stride_qh,
                stride_kvn, H: gl.constexpr, D: gl.constexpr, BN: gl.constexpr,
                NBUF: gl.constexpr):  # fmt: skip
        """The query, then every tile into buffer (tile % NBUF), each announced on
        ready[buffer]; use u of a buffer (tile // NBUF) is phase u & 1 of its barriers."""
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        _load_query(q_row, q_smem, q_ready, stride_qh, H, D, LD)
        for i in range(gl.cdiv(K, BN)):
            b = i % NBUF
            mbarrier.wait(free.index(b), ((i // NBUF) & 1) ^ 1)  # tile i-NBUF consumed, or none
            _issue_tile(kv_ptr, idx_row, kv_smem.index(b), i * BN, N, K, stride_kvn, BN, D, LD)
            # each loader thread's copies arrive on ready[b] when they land (.noinc: the
            # barrier counts the loader's 128 threads), so up to NBUF tiles are in flight and
            # the loader never waits for its own copies (the math side fences before reading)
            async_copy.mbarrier_arrive(ready.index(b), increment_count=False)

    @gluon.jit
    def _math(sink_ptr, out_row, idx_row, q_smem, kv_smem, p_smem, m_smem, l_smem, ready, free,
              q_ready, m_bar, p_bar, l_bar, N, K, qk_scale, stride_oh, WG: gl.constexpr,
              H: gl.constexpr, D: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr):  # fmt: skip
        """Math warpgroup WG: s on tiles WG, WG+2, …; output columns [WG·D/2, (WG+1)·D/2)."""
        HALF: gl.constexpr = D // 2
        S_L: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]
        )
        O_L: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
        )
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        ROWS: gl.constexpr = gl.SliceLayout(1, S_L)
        m, l_one = _sink_start(sink_ptr, H, ROWS)
        l_own = gl.zeros([H], gl.float32, ROWS)
        o = gl.zeros([H, HALF], gl.float32, O_L)
        s_zero = gl.zeros([H, BN], gl.float32, S_L)
        n_tiles = gl.cdiv(K, BN)
        key_cols = gl.arange(0, BN, layout=gl.SliceLayout(0, S_L))
        idx = gl.load(idx_row + WG * BN + key_cols, mask=WG * BN + key_cols < K, other=-1)
        mbarrier.wait(q_ready, 0)
        for r in range(gl.cdiv(n_tiles, 2)):
            ph = r & 1
            mine = 2 * r + WG
            other = 2 * r + 1 - WG
            b_mine, b_other = mine % NBUF, other % NBUF  # with two buffers: WG, 1 − WG
            ph_mine, ph_other = (mine // NBUF) & 1, (other // NBUF) & 1  # with two: ph
            ok = (idx >= 0) & (idx < N)
            # the next round's indices, loaded a round ahead: off the round's critical path at
            # the layer (4.5 % there; 1.6 % slower on the benchmark's contiguous indices, §26)
            offs = (mine + 2) * BN + key_cols
            idx = gl.load(idx_row + offs, mask=offs < K, other=-1)
            if mine < n_tiles:
                mbarrier.wait(ready.index(b_mine), ph_mine)
                fence_async_shared()
                kv = kv_smem.index(b_mine)
                # q's index r // (n_tiles + 1) is 0, opaque to the compiler: its descriptors stay
                # in the loop (hoisted, they spill: docs/performance.md §27)
                q = q_smem.index(r // (n_tiles + 1))
                s = warpgroup_mma(q, kv.permute((1, 0)), s_zero, use_acc=False)
            else:
                s = s_zero
            s = gl.where(ok[None, :], s * qk_scale, float("-inf"))
            m_own = gl.max(s, 1)
            m_smem.index(WG).store(m_own)
            mbarrier.arrive(m_bar, count=1)
            mbarrier.wait(m_bar, ph)
            m_new = gl.maximum(m, gl.maximum(m_own, m_smem.index(1 - WG).load(ROWS)))
            alpha, p = _rescale(s, m, m_new)
            l_own = l_own * alpha + gl.sum(p, 1)
            l_one = l_one * alpha
            m = m_new
            pb = p.to(gl.bfloat16)
            p_smem.index(WG).store(pb)
            fence_async_shared()
            mbarrier.arrive(p_bar, count=1)
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            # its own tile first (its p is in registers), then the other's
            if mine < n_tiles:
                v = kv_smem.index(b_mine).slice(WG * HALF, HALF, dim=1)
                o = warpgroup_mma(gl.convert_layout(pb, P_L), v, o)
                mbarrier.arrive(free.index(b_mine), count=1)
            mbarrier.wait(p_bar, ph)
            if other < n_tiles:
                mbarrier.wait(ready.index(b_other), ph_other)
                v = kv_smem.index(b_other).slice(WG * HALF, HALF, dim=1)
                o = warpgroup_mma(p_smem.index(1 - WG), v, o)
                mbarrier.arrive(free.index(b_other), count=1)
        _write_half(o, l_own, l_one, l_smem, l_bar, out_row, stride_oh, WG, H, HALF, ROWS, O_L)

    @gluon.jit
    def _partition(ROLE: gl.constexpr, q_row, kv_ptr, sink_ptr, out_row, idx_row, q_smem, kv_smem,
                   p_smem, m_smem, l_smem, ready, free, bars, N, K, qk_scale, stride_qh,
                   stride_kvn, stride_oh, H: gl.constexpr, D: gl.constexpr,
                   BN: gl.constexpr, NBUF: gl.constexpr):  # fmt: skip
        """Roles 0 and 1: the math warpgroups; role 2: the loader (one signature for all)."""
        if ROLE == 2:
            _loader(q_row, kv_ptr, idx_row, q_smem.index(0), kv_smem, ready, free, bars.index(0),
                    N, K, stride_qh, stride_kvn, H, D, BN, NBUF)  # fmt: skip
        else:
            _math(sink_ptr, out_row, idx_row, q_smem, kv_smem, p_smem, m_smem, l_smem, ready,
                  free, bars.index(0), bars.index(1), bars.index(2), bars.index(3), N, K,
                  qk_scale, stride_oh, ROLE, H, D, BN, NBUF)  # fmt: skip

    @gluon.jit(do_not_specialize=["N", "K", "stride_it"])
    def _sparse_attention_ws_kernel(
        q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, N, K, qk_scale,
        stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh,
        H: gl.constexpr, D: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr,
        MATH_REGS: gl.constexpr,
        LOAD_REGS: gl.constexpr,
    ):  # fmt: skip
        t = gl.program_id(0).to(gl.int64)
        Q_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, D], gl.bfloat16)
        KV_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], gl.bfloat16)
        P_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, BN], gl.bfloat16)
        V_SL: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [1, H, D], Q_SL)
        kv_smem = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BN, D], KV_SL)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, H, BN], P_SL)
        m_smem = gl.allocate_shared_memory(gl.float32, [2, H], V_SL)
        l_smem = gl.allocate_shared_memory(gl.float32, [2, H], V_SL)
        ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        bars = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NBUF):
            mbarrier.init(ready.index(i), count=128)  # the loader's 4 warps' copies land
            mbarrier.init(free.index(i), count=2)  # both math warpgroups read every tile
        mbarrier.init(bars.index(0), count=1)  # q_ready
        for i in gl.static_range(1, 4):
            mbarrier.init(bars.index(i), count=2)  # m, p, l exchanges (both warpgroups arrive)
        # 4, 5: unused (the removed seesaw schedule's), kept: without them the barriers move
        # and ptxas reschedules the (32, 4) loader, so the SASS would no longer be the measured one
        for i in gl.static_range(4, 6):
            mbarrier.init(bars.index(i), count=1)
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
                        NBUF,
                    ),
                )
                for ROLE in (0, 1, 2)
            ],
            [4, 4],
            [MATH_REGS, LOAD_REGS],
        )


def sparse_attention_gluon_ws(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    sink: Tensor,
    scale: float,
    *,
    config: tuple[int, int] = WS_CONFIG,
) -> Tensor:
    """The warp-specialised Gluon twin of ops.attention.sparse_attention at the Flash shape.
    `config`: (keys per tile, kv buffers), one of WS_CONFIGS."""
    _check_config(config)
    return launch_per_query(_sparse_attention_ws_kernel, q, kv, indices, sink, scale,
                            BN=config[0], NBUF=config[1], MATH_REGS=MATH_REGS,
                            LOAD_REGS=LOAD_REGS, num_warps=4, maxnreg=MAXNREG)  # fmt: skip


def _check_config(config: tuple[int, int]) -> None:
    if config not in WS_CONFIGS:
        raise ValueError(
            f"sparse_attention_gluon_ws: config must be one of {WS_CONFIGS}, got {config}"
        )


def compile_ws_for_hopper(
    math_regs: int = MATH_REGS,
    load_regs: int = LOAD_REGS,
    maxnreg: int = MAXNREG,
    config: tuple[int, int] = WS_CONFIG,
) -> object:
    """The warp-specialised kernel compiled for sm_90 without a GPU (tests)."""
    _check_config(config)
    return compile_for_sm90(
        _sparse_attention_ws_kernel,
        dict(num_warps=4, maxnreg=maxnreg),
        BN=config[0],
        NBUF=config[1],
        MATH_REGS=math_regs,
        LOAD_REGS=load_regs,
    )
