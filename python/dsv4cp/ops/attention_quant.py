"""The V4.1 attention's quantization steps under quant="qat" and the indexer's bf16 score order.

Where each step sits (DeepSeek-V4.1 `inference/model.py`; docs/quantization.md):
- SWA key, `Attention._window_kv`: kv_norm, RoPE on the tail (bf16 after each), then all head_dim
  (512) dims fp8 e4m3 per 32 with ue8m0 scales -> `quant_swa_key_fp8`;
- compressed key, `Attention._compress_kv`: the compressor latent after RoPE (bf16), all dims fp4
  e2m1 per 16 with an e4m3 scale -> `quant_compressed_key_fp4`;
- indexer q and k, `Indexer.forward`: after RoPE (bf16), fp4 e2m1 per 32 with ue8m0 scales ->
  `quant_index_fp4`; scores in bf16 -> `index_scores_qat`;
- sparse attention, `sparse_attn` (kernel.py): online softmax over blocks of 64 indices with the
  probabilities rounded to bf16 before p·v -> `sparse_attention_qat`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4cp.ops.quant import (
    act_quant_fp8,
    fake_act_quant_fp8,
    fake_fp4_quant,
    fake_fp4_quant_e4m3_scale,
    fp4_quant,
    fp4_quant_e4m3_scale,
)

SWA_KEY_BLOCK = 32
COMPRESSED_KEY_BLOCK = 16
INDEX_BLOCK = 32
ATTENTION_BLOCK = 64  # indices per online-softmax step of the reference's sparse_attn
_ATTENTION_ROW_BYTES = 64 << 20  # gathered fp32 keys per row chunk


def quant_swa_key_fp8(k: Tensor) -> tuple[Tensor, Tensor]:
    """SWA key [..., D] (bf16, after kv_norm and RoPE) -> (e4m3 codes [..., D], fp32 ue8m0-exact
    scales [..., D/32]); the cache layout stores these (D bytes + D/32 scale bytes per token)."""
    return act_quant_fp8(k, SWA_KEY_BLOCK)


def fake_quant_swa_key_fp8(k: Tensor) -> Tensor:
    """The SWA key as the reference attends to it: quant_swa_key_fp8 dequantized, in k.dtype."""
    return fake_act_quant_fp8(k, SWA_KEY_BLOCK)


def quant_compressed_key_fp4(c: Tensor) -> tuple[Tensor, Tensor]:
    """Compressed key [..., D] (bf16, after RoPE) -> (packed e2m1 uint8 [..., D/2], fp32
    e4m3-exact scales [..., D/16])."""
    return fp4_quant_e4m3_scale(c, COMPRESSED_KEY_BLOCK)


def fake_quant_compressed_key_fp4(c: Tensor) -> Tensor:
    """The compressed key as the reference attends to it, in c.dtype."""
    return fake_fp4_quant_e4m3_scale(c, COMPRESSED_KEY_BLOCK)


def quant_index_fp4(x: Tensor) -> tuple[Tensor, Tensor]:
    """Indexer q [..., H, D] or k [..., D] (bf16, after RoPE) -> (packed e2m1 uint8 [..., D/2],
    fp32 power-of-two scales [..., D/32])."""
    return fp4_quant(x, INDEX_BLOCK)


def fake_quant_index_fp4(x: Tensor) -> Tensor:
    """Indexer q or k as the reference scores them, in x.dtype."""
    return fake_fp4_quant(x, INDEX_BLOCK)


def index_scores_qat(q: Tensor, k: Tensor, weights: Tensor) -> Tensor:
    """Index scores in the reference's order and precision; fp32 [T, N] holding bf16 values.

    q [T, H, D] and k [N, D] are the fake-fp4 indexer query / key (`fake_quant_index_fp4`),
    weights [T, H] the scaled head weights (rounded to bf16 here, as the reference holds them).
    Reference `Indexer.forward` does it in bf16: s = bf16(q_h · k), relu, bf16(s · w_h), then the
    sum over heads (fp32 accumulation, one bf16 rounding). fp4 × fp4 products are exact, so a
    dot is taken exactly (fp64) and rounded to fp32 then bf16; heads are added in order 0…H-1.
    No mask and no top-k: pass the result to `dsv4cp.ops.indexer.topk_indices` (ties -> the smaller
    index, where the reference's `torch.topk` breaks ties arbitrarily).
    """
    if q.dim() != 3 or k.dim() != 2 or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"index_scores_qat: q [T,H,D], k [N,D]; got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    if tuple(weights.shape) != tuple(q.shape[:2]):
        raise ValueError(
            f"index_scores_qat: weights {tuple(weights.shape)} != q's [T,H] {tuple(q.shape[:2])}"
        )
    q64, k64t = q.double(), k.double().t()
    w = weights.to(torch.bfloat16).float()
    acc = torch.zeros(q.shape[0], k.shape[0], dtype=torch.float32, device=q.device)
    for h in range(q.shape[1]):
        s = (q64[:, h] @ k64t).float().to(torch.bfloat16).float().relu()
        acc = acc + (s * w[:, h, None]).to(torch.bfloat16).float()
    return acc.to(torch.bfloat16).float()


def sparse_attention_qat(
    q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float
) -> Tensor:
    """Sparse attention with a sink, in the reference's order and precision; [T, H, D] in q.dtype.

    Same arguments and meaning as `dsv4cp.ops.attention.sparse_attention` (K = V, -1 indices
    skipped, a row with no valid index gives 0). Reference `sparse_attn` (kernel_cpu.py): fp32
    scores s = (q·k)·scale; online softmax over blocks of 64 indices, the running max m starting
    at -1e30 and never including the sink; each block's p = exp(s - m) enters the fp32 sum as is
    and p·v rounded to bf16 first; the sink's exp(sink - m) is added to the sum at the end.
    """
    t, h, d = q.shape
    if kv.dim() != 2 or kv.shape[1] != d or indices.shape[0] != t or sink.shape != (h,):
        raise ValueError(
            f"sparse_attention_qat: shapes q {tuple(q.shape)}, kv {tuple(kv.shape)}, "
            f"indices {tuple(indices.shape)}, sink {tuple(sink.shape)} do not match"
        )
    n_idx = max(1, min(indices.shape[1], ATTENTION_BLOCK))
    rows = max(1, _ATTENTION_ROW_BYTES // (4 * n_idx * d))
    out = [
        _sparse_attention_rows(q[a : a + rows], kv, indices[a : a + rows], sink, scale)
        for a in range(0, t, rows)
    ]
    return torch.cat(out) if out else q.new_zeros(q.shape)


def _sparse_attention_rows(
    q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float
) -> Tensor:
    t, h, d = q.shape
    qf = q.float()
    acc = torch.zeros(t, h, d, dtype=torch.float32, device=q.device)
    total = torch.zeros(t, h, dtype=torch.float32, device=q.device)
    m = torch.full((t, h), -1e30, dtype=torch.float32, device=q.device)
    scale_f = torch.tensor(scale, dtype=torch.float32, device=q.device)
    for a in range(0, indices.shape[1], ATTENTION_BLOCK):
        idx = indices[:, a : a + ATTENTION_BLOCK].long()
        valid = idx >= 0
        keys = kv.index_select(0, idx.clamp_min(0).flatten()).view(*idx.shape, d).float()
        keys = keys * valid[..., None]
        s = torch.einsum("thd,tkd->thk", qf, keys)
        s = torch.where(valid[:, None, :], s, float("-inf")) * scale_f
        m_prev, m = m, torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m_prev - m)
        p = torch.exp(s - m[..., None])
        total = total * alpha + p.sum(-1)
        pv = torch.einsum("thk,tkd->thd", p.to(torch.bfloat16).float(), keys)
        acc = acc * alpha[..., None] + pv
    total = total + torch.exp(sink.float() - m)
    o = torch.where(total[..., None] > 0, acc / total[..., None], 0.0)
    return o.to(q.dtype)
