"""V4.1 ratio-1/2 compressor (attention-math §5.2) on the fused norm/RoPE row kernel.

The layer's path is two launches and a GEMM: `compress_entries` pools each row with its partner
(the pair state's row or the row above, read in the kernel) → rounds to the latent dtype →
RMSNorm → rounds (the latent L, returned) → RoPE at the entry position → stores the compressed
key at its cache row as the cache keeps it (qat: fp4 codes + e4m3 scales from registers), rows
that emit no entry storing nothing; `_pair_state_kernel` then leaves the even rows' kv and gate
in the pair state. `store_index_keys` runs the index GEMM in torch (cuBLAS) and one norm/RoPE/
encode pass into the index cache. The ops-shaped twins (pair_pool, compressed_latent,
compressed_key, index_key) run single steps of the same kernel; under quant="qat" the last two
also round the RoPE output and fake-quantize the row (fp4 / e4m3 per 16, fp4 / ue8m0 per 32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv4cp.kernels.norm_rope import norm_rope_rows
from dsv4cp.ops.compressor import check_entries_args, check_store_cache
from dsv4cp.ops.kv_format import KVFormat
from dsv4cp.ops.quant import QuantMode, check_quant_mode
from dsv4cp.ops.rope import YarnScaling

# the cache numerics → the fake quant whose codes the kernel stores
_QUANT_OF = {"fp4_e4m3_16": "fp4_e4m3", "fp4_ue8m0_32": "fp4", "fp8_ue8m0_32": "fp8"}


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
    t = latent.shape[0]
    out = torch.empty(t, wk.shape[0], dtype=latent.dtype, device=latent.device)
    rows = torch.arange(t, device=latent.device)
    fmt: KVFormat = "fp4_ue8m0_32" if check_quant_mode(quant) == "qat" else "dense"
    store_index_keys(
        latent, wk, k_norm_weight, eps, entry_positions, rows, out, fmt, rope_dim, theta, yarn
    )
    return out


def _store_mode(fmt: KVFormat, cache: Tensor, dtype: torch.dtype) -> tuple[str | None, bool]:
    """(fake quant, encode) of the kernel that stores keys of numerics fmt into `cache`."""
    check_store_cache(fmt, cache, dtype)
    if fmt == "dense":
        return None, False
    return _QUANT_OF[fmt], cache.dtype == torch.uint8


@triton.jit
def _pair_state_kernel(
    kv_ptr, gate_ptr, row_ptr, src_ptr, skv_ptr, sg_ptr, T, D, stride_kv, stride_s,
    SRC_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    row = tl.load(row_ptr + t).to(tl.int64)
    if row >= 0:
        cols = tl.arange(0, BLOCK_D)
        ok = cols < D
        x_row = t.to(tl.int64)
        if SRC_ROWS:
            x_row = tl.load(src_ptr + t).to(tl.int64)
        src = x_row * stride_kv + cols
        tl.store(skv_ptr + row * stride_s + cols, tl.load(kv_ptr + src, mask=ok), mask=ok)
        tl.store(sg_ptr + row * stride_s + cols, tl.load(gate_ptr + src, mask=ok), mask=ok)


def compress_entries(
    comp_kv: Tensor,
    pair_state: tuple[Tensor, Tensor] | None,
    read_rows: Tensor | None,
    write_rows: Tensor | None,
    norm_weight: Tensor | None,
    eps: float,
    dtype: torch.dtype,
    entry_positions: Tensor,
    emit_rows: Tensor,
    cache: Tensor,
    fmt: KVFormat,
    rope_dim: int,
    theta: float,
    yarn: YarnScaling | None = None,
    src_rows: Tensor | None = None,
) -> Tensor:
    """Triton twin of ops.compressor.compress_entries: one pass over the rows, then the pair
    state's writes (a second launch: a row may read the state row another row writes). With
    `src_rows` both read comp_kv's rows through it (no gathered copy in token order)."""
    quant, encode = _store_mode(fmt, cache, dtype)
    d = check_entries_args(
        comp_kv, pair_state, read_rows, write_rows, entry_positions, emit_rows, src_rows
    )
    t = comp_kv.shape[0] if src_rows is None else src_rows.shape[0]
    if pair_state is None:
        kv, pool, rows = comp_kv, None, None
    else:
        state_kv, state_gate = pair_state
        kv, pool, rows = comp_kv[:, :d], (comp_kv[:, d:], state_kv, state_gate), read_rows
    latent = torch.empty((t, kv.shape[1]), dtype=dtype, device=kv.device)
    norm_rope_rows(
        kv,
        cache,
        positions=entry_positions,
        rope_dim=rope_dim,
        theta=theta,
        yarn=yarn,
        norm_weight=norm_weight,
        eps=eps,
        slots=emit_rows,
        pool=pool,
        pool_rows=rows,
        src_rows=src_rows,
        round_in=True,
        round_mid=True,
        mid=latent,
        fake_quant=quant,
        encode=encode,
        round_dtype=dtype,
    )
    if pair_state is not None and t:
        assert write_rows is not None  # checked above
        _pair_state_kernel[(t,)](
            comp_kv,
            comp_kv[:, d:],
            write_rows.contiguous(),
            write_rows if src_rows is None else src_rows.contiguous(),
            state_kv,
            state_gate,
            t,
            d,
            comp_kv.stride(0),
            state_kv.stride(0),
            SRC_ROWS=src_rows is not None,
            BLOCK_D=triton.next_power_of_2(d),
        )
    return latent


def store_index_keys(
    latent: Tensor,
    wk: Tensor,
    k_norm_weight: Tensor | None,
    eps: float,
    entry_positions: Tensor,
    emit_rows: Tensor,
    cache: Tensor,
    fmt: KVFormat,
    rope_dim: int,
    theta: float,
    yarn: YarnScaling | None = None,
) -> None:
    """Triton twin of ops.compressor.store_index_keys: the GEMM in torch, then one norm/RoPE
    pass storing each emitted row at its cache row (qat: fp4 codes + ue8m0 scale bytes)."""
    quant, encode = _store_mode(fmt, cache, latent.dtype)
    proj = latent @ wk.to(latent.dtype).t()
    norm_rope_rows(
        proj,
        cache,
        positions=entry_positions,
        rope_dim=rope_dim,
        theta=theta,
        yarn=yarn,
        norm_weight=k_norm_weight,
        eps=eps,
        slots=emit_rows,
        round_mid=True,
        fake_quant=quant,
        encode=encode,
        round_dtype=latent.dtype,
    )
