"""V4.1 kv-source compressor pieces (attention-math §5.2).

quant="qat" adds the reference's fp4 steps (DeepSeek-V4.1 `inference/model.py`:
`Attention._compress_kv` for the compressed key, `Indexer.forward` for the index key); the pooling
and the latent are the same in both modes (`Compressor.forward`: fp32 pooling, latent rounded to
the activation dtype before and after its norm).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4cp.ops.attention_quant import fake_quant_compressed_key_fp4, fake_quant_index_fp4
from dsv4cp.ops.matmul import linear_rows
from dsv4cp.ops.norm import rms_norm
from dsv4cp.ops.quant import QuantMode, check_quant_mode
from dsv4cp.ops.rope import YarnScaling, apply_rope


def pair_pool(kv: Tensor, gate: Tensor, partner_kv: Tensor, partner_gate: Tensor) -> Tensor:
    """Per-channel softmax over (partner = even token 2j, row = odd token 2j+1); fp32 [T, D]."""
    g0, g1 = partner_gate.float(), gate.float()
    m = torch.maximum(g0, g1)
    e0, e1 = torch.exp(g0 - m), torch.exp(g1 - m)
    return (e0 * partner_kv.float() + e1 * kv.float()) / (e0 + e1)


def compressed_latent(
    pooled_or_kv: Tensor,
    norm_weight: Tensor | None,
    eps: float,
    dtype: torch.dtype,
) -> Tensor:
    """Pre-RoPE latent L = rms_norm(pooled rounded to dtype), in dtype [n, D]."""
    return rms_norm(pooled_or_kv.to(dtype), norm_weight, eps, out_dtype=dtype)


def compressed_key(
    latent: Tensor,
    entry_positions: Tensor,
    rope_dim: int,
    theta: float,
    yarn: YarnScaling | None = None,
    quant: QuantMode = "none",
) -> Tensor:
    """Compressed attention key: latent roped at its entry position j·r, in latent.dtype; under
    "qat" then all dims fp4 e2m1 per 16 with e4m3 scales, dequantized."""
    key = apply_rope(latent, entry_positions, rope_dim, theta, yarn)
    if check_quant_mode(quant) == "qat":
        return fake_quant_compressed_key_fp4(key)
    return key


def index_key(
    latent: Tensor,
    wk: Tensor,
    k_norm_weight: Tensor | None,
    eps: float,
    entry_positions: Tensor,
    rope_dim: int,
    theta: float,
    yarn: YarnScaling | None = None,
    quant: QuantMode = "none",
) -> Tensor:
    """Index key [n, D_I] = rope(rms_norm(latent @ wkᵀ)); the GEMM, the norm and RoPE round to
    latent's dtype; under "qat" then fp4 e2m1 per 32 with ue8m0 scales, dequantized."""
    proj = linear_rows(latent, wk.to(latent.dtype))
    k = rms_norm(proj, k_norm_weight, eps)
    key = apply_rope(k, entry_positions, rope_dim, theta, yarn)
    if check_quant_mode(quant) == "qat":
        return fake_quant_index_fp4(key)
    return key
