"""V4.1 ratio-1/2 compressor tail (attention-math §5.2) on the fused norm/RoPE row kernel.

compress_store does pair pool (ratio 2) → round to the cache dtype → RMSNorm → round (the latent
L, also returned) → RoPE at the entry position → write the compressed key at its cache slot, in
one pass. The ops-shaped twins below run single steps of the same kernel. index_key keeps its
GEMM in torch (cuBLAS) and fuses the norm and RoPE after it. Under quant="qat" compressed_key and
index_key also round the RoPE output and fake-quantize the row (fp4 / e4m3 per 16, fp4 / ue8m0
per 32) in the same pass; compress_store has no quant step (not on the layer's path).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4cp.kernels.norm_rope import norm_rope_rows
from dsv4cp.ops.quant import QuantMode, check_quant_mode
from dsv4cp.ops.rope import YarnScaling


def pair_pool(kv: Tensor, gate: Tensor, partner_kv: Tensor, partner_gate: Tensor) -> Tensor:
    """Triton twin of ops.compressor.pair_pool: fp32 [T, D]."""
    out = torch.empty(kv.shape, dtype=torch.float32, device=kv.device)
    norm_rope_rows(
        kv,
        out,
        positions=None,
        rope_dim=0,
        theta=1.0,
        yarn=None,
        norm=False,
        pool=(gate, partner_kv, partner_gate),
    )
    return out


def compressed_latent(
    pooled_or_kv: Tensor, norm_weight: Tensor | None, eps: float, dtype: torch.dtype
) -> Tensor:
    """Triton twin of ops.compressor.compressed_latent: rms_norm(x rounded to dtype) in dtype."""
    out = torch.empty(pooled_or_kv.shape, dtype=dtype, device=pooled_or_kv.device)
    norm_rope_rows(
        pooled_or_kv,
        out,
        positions=None,
        rope_dim=0,
        theta=1.0,
        yarn=None,
        norm_weight=norm_weight,
        eps=eps,
        round_in=True,
    )
    return out


def compressed_key(
    latent: Tensor,
    entry_positions: Tensor,
    rope_dim: int,
    theta: float,
    yarn: YarnScaling | None = None,
    quant: QuantMode = "none",
) -> Tensor:
    """Triton twin of ops.compressor.compressed_key: apply_rope(latent) in latent.dtype ("qat":
    then fp4 e2m1 per 16 with e4m3 scales, dequantized)."""
    out = torch.empty_like(latent, memory_format=torch.contiguous_format)
    norm_rope_rows(
        latent,
        out,
        positions=entry_positions,
        rope_dim=rope_dim,
        theta=theta,
        yarn=yarn,
        norm=False,
        fake_quant="fp4_e4m3" if check_quant_mode(quant) == "qat" else None,
    )
    return out


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
    """Triton twin of ops.compressor.index_key: GEMM in latent.dtype, then fused norm + rope
    ("qat": + fp4 e2m1 per 32 with ue8m0 scales, dequantized)."""
    proj = latent @ wk.to(latent.dtype).t()
    out = torch.empty_like(proj)
    norm_rope_rows(
        proj,
        out,
        positions=entry_positions,
        rope_dim=rope_dim,
        theta=theta,
        yarn=yarn,
        norm_weight=k_norm_weight,
        eps=eps,
        round_mid=True,
        fake_quant="fp4" if check_quant_mode(quant) == "qat" else None,
    )
    return out


def compress_store(
    kv: Tensor,
    gate: Tensor | None,
    partner_kv: Tensor | None,
    partner_gate: Tensor | None,
    entry_positions: Tensor,
    slots: Tensor,
    cache: Tensor,
    norm_weight: Tensor | None,
    eps: float,
    rope_dim: int,
    theta: float,
    yarn: YarnScaling | None = None,
) -> Tensor:
    """Fused ratio-1/2 compressor tail: cache[slots] = rope(L); returns L [n, D] in cache.dtype.

    Ratio 2: kv/gate are the odd rows, partner_kv/partner_gate the even rows (fp32). Ratio 1:
    gate = partner_kv = partner_gate = None and kv is the bf16 projection.
    """
    pool = None
    if gate is not None:
        if partner_kv is None or partner_gate is None:
            raise ValueError("compress_store: ratio 2 needs gate, partner_kv and partner_gate")
        pool = (gate, partner_kv, partner_gate)
    latent = torch.empty(kv.shape, dtype=cache.dtype, device=kv.device)
    norm_rope_rows(
        kv,
        cache,
        positions=entry_positions,
        rope_dim=rope_dim,
        theta=theta,
        yarn=yarn,
        norm_weight=norm_weight,
        eps=eps,
        slots=slots,
        pool=pool,
        round_in=True,
        round_mid=True,
        mid=latent,
    )
    return latent
