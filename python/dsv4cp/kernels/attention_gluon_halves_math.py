"""The math warpgroups of the half-buffer Gluon sparse attention (`attention_gluon_halves`, which
holds its loader, kernel and host launch and describes the tiles, the kv buffers' halves and
their barriers), `math_partition`:

- warpgroup w computes s = q·kᵀ of its own tile (both halves), and accumulates output columns
  half w over both tiles — warpgroup 0 reads only the L halves as v, warpgroup 1 only the R
  halves, so each half is freed by one warpgroup: A_L and B_L by warpgroup 0, B_R and A_R by
  warpgroup 1;
- the maxima are chained, not exchanged (FlashMLA's "seesaw"): warpgroup 0 takes m_a from its
  tile and goes on to p_A·v_A(L) while warpgroup 1 waits for m_a and takes
  m_b = max(m_a, rowmax s_B); warpgroup 0 then rescales what it holds by 2^(m_a − m_b) and
  publishes p_A at m_b, so one warpgroup's exponentials overlap the other's products;
- warpgroup 0 computes the next round's q·kᵀ (L half, then R) right after its last p·v, so its
  next maximum is ready while warpgroup 1 finishes the round (queuing it asynchronously behind
  that p·v, as FlashMLA does, measured 1 % slower in docs/performance.md §27 and 6 % slower
  in §28, with the registers for it);
- warpgroup 1 queues its own p_B·v_B(R) asynchronously, stores p_B while it runs, then queues
  p_A·v_A(R) behind it and frees B_R and A_R as each completes (FlashMLA's order);
- each warpgroup's output half is staged in the query's buffer once both have passed their last
  q·kᵀ, then written with 16-byte stores (`_write_half_staged`).

The math is the Triton kernel's (kernels/attention.py; twin ops.attention.sparse_attention):
the sink starts the running max and the running sum at e^0; −1 and out-of-range indices are
masked; a row with no valid key gives 0; p is rounded to bf16 for p·v (warpgroup 0's own p at
its m_a, the published one at m_b).
"""

from __future__ import annotations

from dsv4cp.kernels.attention_gluon import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from dsv4cp.kernels.attention_gluon import (
        _cta_barrier,
        _normalize_half,
        _rescale,
        _sink_start,
    )

    # the four halves' barrier slots: buffer b's half h is b·2 + h
    A_L = gl.constexpr(0)
    A_R = gl.constexpr(1)
    B_L = gl.constexpr(2)
    B_R = gl.constexpr(3)

    @gluon.jit
    def _write_half_staged(o, l_own, l_one, l_smem, l_bar, o_smem, out_row, stride_oh,
                           WG: gl.constexpr, H: gl.constexpr, HALF: gl.constexpr,
                           ROWS: gl.constexpr, O_L: gl.constexpr):  # fmt: skip
        """o / (both halves' l + the sink's), staged in `o_smem` (the query's buffer, free
        once both warpgroups pass `l_bar`), then stored 8 bf16 a thread."""
        # past l_bar both warpgroups are past their last q·kᵀ: q's buffer is free
        o = _normalize_half(o, l_own, l_one, l_smem, l_bar, WG, ROWS, O_L)
        half = o_smem.slice(WG * HALF, HALF, dim=1)
        half.store(o.to(gl.bfloat16))
        _cta_barrier()
        ST: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        v = half.load(ST)
        heads = gl.arange(0, H, layout=gl.SliceLayout(1, ST))
        cols = WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, ST))
        gl.store(out_row + heads[:, None] * stride_oh + cols[None, :], v)

    @gluon.jit
    def _issue_qk(
        q_smem,
        kv,
        ready,
        first: gl.constexpr,
        ph,
        S_L: gl.constexpr,
        H: gl.constexpr,
        BN: gl.constexpr,
        HALF: gl.constexpr,
    ):
        """Queue s = q·kᵀ over a tile's two halves, `first` half first (0: L), each once its
        half has landed: the asynchronous accumulator."""
        mbarrier.wait(ready.index(first), ph)
        fence_async_shared()
        q0 = q_smem.slice(first % 2 * HALF, HALF, dim=1)
        k0 = kv.slice(first % 2 * HALF, HALF, dim=1).permute((1, 0))
        s = warpgroup_mma(q0, k0, gl.zeros([H, BN], gl.float32, S_L), use_acc=False, is_async=True)
        second: gl.constexpr = first + 1 - 2 * (first % 2)
        mbarrier.wait(ready.index(second), ph)
        fence_async_shared()
        q1 = q_smem.slice(second % 2 * HALF, HALF, dim=1)
        k1 = kv.slice(second % 2 * HALF, HALF, dim=1).permute((1, 0))
        return warpgroup_mma(q1, k1, s, is_async=True)

    @gluon.jit
    def math_partition(sink_ptr, out_row, idx_row, q_smem, kv_smem, p_smem, m_smem, l_smem, ready,
                       free, q_ready, ma_bar, mb_bar, p0_bar, p1_bar, l_bar, N, K, qk_scale,
                       stride_oh, WG: gl.constexpr, H: gl.constexpr, D: gl.constexpr,
                       BN: gl.constexpr):  # fmt: skip
        """Math warpgroup WG: q·kᵀ on its buffer's tiles; output columns [WG·D/2, (WG+1)·D/2)."""
        HALF: gl.constexpr = D // 2
        S_L: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]
        )
        O_L: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
        )
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        ROWS: gl.constexpr = gl.SliceLayout(1, S_L)
        O_ROWS: gl.constexpr = gl.SliceLayout(1, O_L)
        m, l_one = _sink_start(sink_ptr, H, ROWS)
        l_own = gl.zeros([H], gl.float32, ROWS)
        o = gl.zeros([H, HALF], gl.float32, O_L)
        s_zero = gl.zeros([H, BN], gl.float32, S_L)
        n_tiles = gl.cdiv(K, BN)
        key_cols = gl.arange(0, BN, layout=gl.SliceLayout(0, S_L))
        idx = gl.load(idx_row + WG * BN + key_cols, mask=WG * BN + key_cols < K, other=-1)
        mbarrier.wait(q_ready, 0)
        s = s_zero
        if WG == 0:
            if n_tiles > 0:  # round 0's q·kᵀ; later rounds' are queued a round ahead
                s = warpgroup_mma_wait(0, deps=[_issue_qk(q_smem.index(0), kv_smem.index(0),
                                                          ready, A_L, 0, S_L, H, BN,
                                                          HALF)])  # fmt: skip
        for r in range(gl.cdiv(n_tiles, 2)):
            ph = r & 1
            # z = 0, opaque to the compiler: the shared-memory descriptors stay in the loop
            # (hoisted, q·kᵀ's 64 of them spill: docs/performance.md §27)
            z = r // (n_tiles + 1)
            q_z = q_smem.index(z)
            kv_a = kv_smem.index(z)
            kv_b = kv_smem.index(z + 1)
            v_a = kv_a.slice(WG * HALF, HALF, dim=1)  # warpgroup 0: A_L, B_L; 1: A_R, B_R
            v_b = kv_b.slice(WG * HALF, HALF, dim=1)
            has_b = 2 * r + 1 < n_tiles
            ok = (idx >= 0) & (idx < N)
            offs = (2 * r + 2 + WG) * BN + key_cols  # the next round's indices
            idx = gl.load(idx_row + offs, mask=offs < K, other=-1)
            if WG == 0:  # tile A, always present
                s = gl.where(ok[None, :], s * qk_scale, float("-inf"))
                m_a = gl.maximum(m, gl.max(s, 1))
                m_smem.index(0).store(m_a)
                mbarrier.arrive(ma_bar, count=1)
                alpha, p = _rescale(s, m, m_a)
                l_own = l_own * alpha + gl.sum(p, 1)
                l_one = l_one * alpha
                o = o * gl.convert_layout(alpha, O_ROWS)[:, None]
                pb = p.to(gl.bfloat16)  # only the bf16 p stays live (registers)
                o = warpgroup_mma(gl.convert_layout(pb, P_L), v_a, o)
                mbarrier.arrive(free.index(A_L), count=1)
                mbarrier.wait(mb_bar, ph)
                m_b = m_smem.index(1).load(ROWS)
                c = gl.exp2(m_a - gl.where(m_b == float("-inf"), 0.0, m_b))  # 0 if both −∞
                p_smem.index(0).store((pb.to(gl.float32) * c[:, None]).to(gl.bfloat16))  # at m_b
                fence_async_shared()
                mbarrier.arrive(p0_bar, count=1)
                l_own = l_own * c
                l_one = l_one * c
                o = o * gl.convert_layout(c, O_ROWS)[:, None]
                m = m_b
                mbarrier.wait(p1_bar, ph)
                if has_b:
                    mbarrier.wait(ready.index(B_L), ph)
                    o = warpgroup_mma(p_smem.index(1), v_b, o)
                    mbarrier.arrive(free.index(B_L), count=1)
                    if 2 * r + 2 < n_tiles:  # the next round's tile A
                        s = warpgroup_mma_wait(0, deps=[_issue_qk(q_z, kv_a, ready, A_L, ph ^ 1,
                                                                  S_L, H, BN, HALF)])  # fmt: skip
            else:  # tile B, absent in an odd count's last round; tile A always present
                if has_b:
                    s = warpgroup_mma_wait(0, deps=[_issue_qk(q_z, kv_b, ready, B_R, ph,
                                                              S_L, H, BN, HALF)])  # fmt: skip
                else:
                    s = s_zero
                s = gl.where(ok[None, :], s * qk_scale, float("-inf"))
                mbarrier.wait(ma_bar, ph)
                m_b = gl.maximum(m_smem.index(0).load(ROWS), gl.max(s, 1))
                m_smem.index(1).store(m_b)
                mbarrier.arrive(mb_bar, count=1)
                alpha, p = _rescale(s, m, m_b)
                l_own = l_own * alpha + gl.sum(p, 1)
                l_one = l_one * alpha
                m = m_b
                pb = p.to(gl.bfloat16)
                o = o * gl.convert_layout(alpha, O_ROWS)[:, None]
                if has_b:  # own p·v queued; p_B stored while it runs
                    acc = warpgroup_mma(gl.convert_layout(pb, P_L), v_b, o, is_async=True)
                    p_smem.index(1).store(pb)
                    mbarrier.wait(p0_bar, ph)
                    mbarrier.wait(ready.index(A_R), ph)
                    acc = warpgroup_mma(p_smem.index(0), v_a, acc, is_async=True)
                    fence_async_shared()
                    mbarrier.arrive(p1_bar, count=1)
                    o = warpgroup_mma_wait(1, deps=[acc])
                    mbarrier.arrive(free.index(B_R), count=1)
                    o = warpgroup_mma_wait(0, deps=[o])
                    mbarrier.arrive(free.index(A_R), count=1)
                else:
                    p_smem.index(1).store(pb)
                    fence_async_shared()
                    mbarrier.arrive(p1_bar, count=1)
                    mbarrier.wait(p0_bar, ph)
                    mbarrier.wait(ready.index(A_R), ph)
                    o = warpgroup_mma(p_smem.index(0), v_a, o)
                    mbarrier.arrive(free.index(A_R), count=1)
        _write_half_staged(o, l_own, l_one, l_smem, l_bar, q_smem.index(0), out_row, stride_oh,
                           WG, H, HALF, ROWS, O_L)  # fmt: skip
