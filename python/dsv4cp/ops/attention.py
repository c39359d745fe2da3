"""Sparse attention with an attention sink (attention-math §4.6), over one dense KV tensor or
straight over the two caches a V4.1 layer reads, each in its storage format.

DeepSeek's reference (`inference/model.py` `Attention.forward`) concatenates the window keys and
the compressed keys into one KV and calls `sparse_attn` with the concatenated indices;
`sparse_attention_cached` keeps the two caches apart (SWA rows, then compressed rows, in that
order) and dequantizes only the rows it reads (`ops.kv_format.decode_rows`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4cp.ops.attention_quant import sparse_attention_qat
from dsv4cp.ops.kv_format import decode_rows, row_width
from dsv4cp.ops.quant import QuantMode, check_quant_mode
from dsv4cp.ops.workspace_rows import WorkspaceMemo


def _attend(q: Tensor, keys: Tensor, valid: Tensor, sink: Tensor, scale: float) -> Tensor:
    """q [T,H,D], keys fp32 [T,K,D] (K = V), valid [T,K] → [T,H,D] in q.dtype."""
    h = q.shape[1]
    s = torch.einsum("thd,tkd->thk", q.float(), keys) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    sink_f = sink.float().view(1, h, 1)
    s_max = s.amax(-1, keepdim=True) if keys.shape[1] else torch.full_like(sink_f, float("-inf"))
    m = torch.maximum(s_max, sink_f)
    m = torch.where(m == float("-inf"), 0.0, m)  # no key and sink = -inf: keep exp finite
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True) + torch.exp(sink_f - m)
    o = torch.einsum("thk,tkd->thd", p, keys)
    o = o / torch.where(denom > 0, denom, 1.0)  # as the kernel: NaN stays NaN, no key → 0
    return o.to(q.dtype)


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
    keys = kv.index_select(0, indices.long().clamp_min(0).flatten()).view(t, n_idx, d).float()
    return _attend(q, keys, indices >= 0, sink, scale)


def _cached_keys(
    cache: Tensor | None, indices: Tensor | None, fmt: str, t: int, d: int, what: str
) -> tuple[Tensor, Tensor]:
    """(fp32 keys [T, K, D], valid [T, K]) of one cache's rows; K = 0 without a cache."""
    if cache is None or indices is None:
        if (cache is None) != (indices is None):
            raise ValueError(f"sparse_attention_cached: {what} and its indices come together")
        empty = torch.zeros(t, 0, d, dtype=torch.float32)
        return empty, torch.zeros(t, 0, dtype=torch.bool)
    width = row_width(fmt, d)
    if cache.dim() != 2 or cache.shape[1] != width or indices.dim() != 2 or indices.shape[0] != t:
        raise ValueError(
            f"sparse_attention_cached: {what} must be [N, {width}] ({fmt}) with indices "
            f"[{t}, K], got {tuple(cache.shape)} and {tuple(indices.shape)}"
        )
    n_idx = indices.shape[1]
    rows = cache.index_select(0, indices.long().clamp_min(0).flatten())
    keys = decode_rows(rows, fmt, d).view(t, n_idx, d)
    valid = indices >= 0
    return torch.where(valid[..., None], keys, 0.0), valid  # -1 reads row 0: whatever it holds


def sparse_attention_cached(
    q: Tensor,
    swa: Tensor,
    swa_indices: Tensor,
    comp: Tensor | None,
    comp_indices: Tensor | None,
    sink: Tensor,
    scale: float,
    swa_format: str = "dense",
    comp_format: str = "dense",
    quant: QuantMode = "none",
    *,
    workspace_rows: tuple[int, int] | None = None,
    workspace_memo: WorkspaceMemo | None = None,
    comp_rows: Tensor | None = None,
) -> Tensor:
    """Sparse attention over the keys swa[swa_indices] then comp[comp_indices], each cache
    stored in its format (`ops.kv_format`: dense, or quantized rows decoded here to fp32).

    q [T,H,D]; swa [N_swa, row] and swa_indices [T,W]; comp [N_c, row] and comp_indices [T,K]
    (both None for a layer without compressed keys); -1 indices skipped; → [T,H,D] in q.dtype.
    Equal to `sparse_attention` ("none") or `attention_quant.sparse_attention_qat` ("qat": the
    reference's block order and probability rounding) over the dequantized rows concatenated in
    that order. `workspace_rows` (SWA rows, compressed rows) bounds the distinct rows the
    indices name, for the CUDA path's bf16 workspace (`kernels/attention_workspace.py`); unused
    here, as are `workspace_memo` (where the CUDA path keeps that workspace for the next layer)
    and `comp_rows` (the batch's compressed rows, that workspace's dense list).
    """
    t, h, d = q.shape
    if sink.shape != (h,):
        raise ValueError(f"sparse_attention_cached: sink must be [{h}], got {tuple(sink.shape)}")
    k_swa, v_swa = _cached_keys(swa, swa_indices, swa_format, t, d, "swa")
    k_comp, v_comp = _cached_keys(comp, comp_indices, comp_format, t, d, "comp")
    keys = torch.cat([k_swa.to(q.device), k_comp.to(q.device)], dim=1)
    valid = torch.cat([v_swa.to(q.device), v_comp.to(q.device)], dim=1)
    if check_quant_mode(quant) == "none":
        return _attend(q, keys, valid, sink, scale)
    # row t's keys are rows t·K … t·K+K−1 of the flattened keys
    n_idx = keys.shape[1]
    rows = torch.arange(t, device=q.device)[:, None] * n_idx + torch.arange(n_idx, device=q.device)
    return sparse_attention_qat(q, keys.flatten(0, 1), torch.where(valid, rows, -1), sink, scale)
