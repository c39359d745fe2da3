"""A candidate consumer at long context: score only the keys of each row's published blocks.

`gather_kernel` (used when the rows see several times more keys than their published positions,
`indexer_topk_plan.plan_gather`): per row, only the keys of its published blocks are loaded and
scored, all heads of the row in one tensor-core product per tile of blocks (`index_score`), with
the same running buffer, cut by `running_topk.cut_rows`. `launch_gather` sorts and deduplicates
the block ids first so that columns arrive in ascending order, which the tie rule needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv4cp.kernels._triton import dot_flags
from dsv4cp.kernels.index_score import head_term, index_score
from dsv4cp.kernels.running_topk import cut_rows
from dsv4cp.kernels.topk_common import sortable_key


@triton.jit
def gather_kernel(
    q_ptr, w_ptr, k_ptr, nvis_ptr, kstart_ptr, ids_ptr, sk_ptr, si_ptr, cnt_ptr, tau_ptr, out_ptr,
    T, H, N, WIDTH, NB, MB,
    stride_qt, stride_qh, stride_wt, stride_kn, stride_it, stride_ot,
    K: tl.constexpr, K_PAD: tl.constexpr, CAP: tl.constexpr, KEY_BITS: tl.constexpr,
    HAS_KSTART: tl.constexpr,
    D: tl.constexpr, H_PAD: tl.constexpr, BS: tl.constexpr, BPT: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, QAT: tl.constexpr, RNE: tl.constexpr,
    PACKED: tl.constexpr,
):  # fmt: skip
    # A consumer at long context: per row, only its published blocks (ascending ids, -1 skipped)
    # are scored, BPT blocks of BS keys per tile, all heads of the row in one product.
    pid = tl.program_id(0)
    slot = pid + tl.arange(0, 1)  # this program's buffer (rows pid, pid + grid, ...)
    d = tl.arange(0, D)
    hh = tl.arange(0, H_PAD)
    o = tl.arange(0, K_PAD)
    bj = tl.arange(0, BPT)
    off = tl.arange(0, BS)
    for row in range(pid, T, tl.num_programs(0)):
        r64 = row * tl.full([], 1, tl.int64)  # row is a plain int in the interpreter
        n = tl.maximum(tl.minimum(tl.load(nvis_ptr + r64).to(tl.int32), WIDTH), 0)
        ks = 0
        if HAS_KSTART:
            ks = tl.load(kstart_ptr + r64).to(tl.int32)
        qt = tl.load(
            q_ptr + r64 * stride_qt + hh[:, None] * stride_qh + d[None, :],
            mask=(hh < H)[:, None],
            other=0.0,
        )
        if UPCAST:
            qt = qt.to(tl.float32)
        wt = tl.load(w_ptr + r64 * stride_wt + hh, mask=hh < H, other=0.0)
        cnt = tl.zeros([1], dtype=tl.int32)
        tau = tl.full([1], -2147483648, tl.int32)
        for b0 in range(0, MB, BPT):
            ids = tl.load(ids_ptr + r64 * stride_it + b0 + bj, mask=b0 + bj < MB, other=-1)
            ok = (ids >= 0) & (ids < NB)
            cols = tl.reshape(ids[:, None] * BS + off[None, :], [BPT * BS])
            valid = tl.reshape(ok[:, None] & (off >= 0)[None, :], [BPT * BS]) & (cols < n)
            kt = tl.load(
                k_ptr + (ks + cols)[None, :].to(tl.int64) * stride_kn + d[:, None],
                mask=(valid & (ks + cols < N))[None, :],
                other=0.0,
            )
            if UPCAST:
                kt = kt.to(tl.float32)
            s = tl.dot(qt, kt, input_precision=DOT_PREC)
            terms = head_term(s, wt[:, None], QAT, RNE, PACKED)
            logit = index_score(tl.sum(terms, 0), QAT, RNE, PACKED)
            key = sortable_key(logit)
            take = valid & (logit > float("-inf")) & (key > tau)
            n_take = tl.sum(take.to(tl.int32), 0)
            if n_take > 0:
                at = pid.to(tl.int64) * CAP + cnt + tl.cumsum(take.to(tl.int32), 0) - 1
                tl.store(sk_ptr + at, key, mask=take)
                tl.store(si_ptr + at, cols, mask=take)
                cnt += n_take
                if tl.max(cnt, 0) > CAP - BPT * BS:
                    tl.store(cnt_ptr + slot, cnt)
                    tl.debug_barrier()
                    cut_rows(
                        sk_ptr, si_ptr, cnt_ptr, tau_ptr, slot.to(tl.int64), slot >= 0, 1, CAP, K,
                        KEY_BITS,
                    )  # fmt: skip
                    tl.debug_barrier()
                    cnt = tl.load(cnt_ptr + slot)
                    tau = tl.load(tau_ptr + slot)
        tl.store(cnt_ptr + slot, cnt)
        tl.debug_barrier()
        cut_rows(
            sk_ptr, si_ptr, cnt_ptr, tau_ptr, slot.to(tl.int64), slot >= 0, 1, CAP, K, KEY_BITS
        )
        tl.debug_barrier()
        c = tl.max(tl.load(cnt_ptr + slot), 0)
        sel = tl.load(si_ptr + pid.to(tl.int64) * CAP + o, mask=o < c, other=-1)
        tl.store(out_ptr + r64 * stride_ot + o, tl.where(o < c, sel, -1), mask=o < K)
        tl.debug_barrier()  # the next row reuses the buffer


def launch_gather(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    n_visible: Tensor,
    k_start: Tensor | None,
    block_ids: Tensor,
    out: Tensor,
    width: int,
    block_size: int,
    block_n: int,
    cap: int,
    nb: int,
    qat: bool = False,
    key_bits: int = 32,
    packed: bool = True,
) -> None:
    """The consumer's gather mode into `out`: ids sorted, duplicates dropped (the kernel appends
    columns in ascending order, which the tie rule needs), one buffer per program."""
    t, h, d = q.shape
    ids = block_ids.to(torch.int32).sort(dim=1).values
    dup = torch.zeros_like(ids, dtype=torch.bool)
    dup[:, 1:] = ids[:, 1:] == ids[:, :-1]
    ids = ids.masked_fill(dup, -1)
    dev = q.device
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 2
    grid = min(t, 8 * sms)
    sk = torch.empty((grid, cap), dtype=torch.int32, device=dev)
    si = torch.empty_like(sk)
    cnt = torch.empty((grid,), dtype=torch.int32, device=dev)
    tau = torch.empty_like(cnt)
    gather_kernel[(grid,)](
        q, weights, k, n_visible, n_visible if k_start is None else k_start.contiguous(),
        ids, sk, si, cnt, tau, out,
        t, h, k.shape[0], width, nb, ids.shape[1],
        q.stride(0), q.stride(1), weights.stride(0), k.stride(0), ids.stride(0), out.stride(0),
        K=out.shape[1], K_PAD=triton.next_power_of_2(out.shape[1]), CAP=cap, KEY_BITS=key_bits,
        HAS_KSTART=k_start is not None, D=d, H_PAD=max(16, triton.next_power_of_2(h)),
        BS=block_size, BPT=block_n // block_size,
        **dot_flags(q.dtype), QAT=qat, PACKED=packed, num_warps=4,
    )  # fmt: skip
