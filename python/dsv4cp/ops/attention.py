"""Sparse attention with an attention sink (attention-math §4.6)."""

from __future__ import annotations

import torch
from torch import Tensor


def sparse_attention(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    sink: Tensor,
    scale: float,
) -> Tensor:
    """o[t,h] = Σ e^{s-m} kv[idx] / (Σ e^{s-m} + e^{sink[h]-m}); -1 indices skipped.

    q [T,H,D], kv [N,D] (K = V), indices [T,K], sink [H] fp32 → [T,H,D] in q.dtype. Duplicate
    indices count once per occurrence; a row with no valid index gives 0 (0 / 1 when the sink is
    -inf too). NaN in q, a visible key or the sink gives NaN in the heads it reaches, as in the
    Triton kernel (`kernels/attention.py`), never a silent 0.
    """
    t, h, d = q.shape
    if kv.dim() != 2 or kv.shape[1] != d or indices.shape[0] != t or sink.shape != (h,):
        raise ValueError(
            f"sparse_attention: shapes q {tuple(q.shape)}, kv {tuple(kv.shape)}, "
            f"indices {tuple(indices.shape)}, sink {tuple(sink.shape)} do not match"
        )
    n_idx = indices.shape[1]
    valid = indices >= 0
    keys = kv.index_select(0, indices.long().clamp_min(0).flatten()).view(t, n_idx, d).float()
    s = torch.einsum("thd,tkd->thk", q.float(), keys) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    sink_f = sink.float().view(1, h, 1)
    s_max = s.amax(-1, keepdim=True) if n_idx else torch.full_like(sink_f, float("-inf"))
    m = torch.maximum(s_max, sink_f)
    m = torch.where(m == float("-inf"), 0.0, m)  # no key and sink = -inf: keep exp finite
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True) + torch.exp(sink_f - m)
    o = torch.einsum("thk,tkd->thd", p, keys)
    o = o / torch.where(denom > 0, denom, 1.0)  # as the kernel: NaN stays NaN, no key → 0
    return o.to(q.dtype)
