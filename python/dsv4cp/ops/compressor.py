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
from dsv4cp.ops.kv_format import KVFormat, check_format, stored_rows
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


def _store_at(cache: Tensor, rows: Tensor, values: Tensor) -> None:
    """cache[rows] = values where rows >= 0, without a host sync (no mask compaction): a row of
    -1 writes the same value to the same row as the first kept row (or, when none is kept, row
    0's own value back), so the duplicate writes agree whatever order they land in."""
    if rows.numel() == 0:
        return
    keep = rows >= 0
    vals = values.to(cache.dtype)
    j = keep.to(torch.int32).argmax().view(1)  # the first kept row (0 when none is)
    target = rows.index_select(0, j).clamp(min=0)  # tensors, not Python ints: no item()
    fill = torch.where(
        keep.index_select(0, j)[:, None], vals.index_select(0, j), cache.index_select(0, target)
    )
    idx = torch.where(keep, rows, target)
    cache.index_put_((idx,), torch.where(keep[:, None], vals, fill))


def check_store_cache(fmt: KVFormat, cache: Tensor, dtype: torch.dtype) -> None:
    """ValueError when keys of dtype cannot be stored in `cache` as format fmt: a dense cache
    holds them in their own dtype (its kernel and twin both call this; no silent cast)."""
    if check_format(fmt) == "dense" and cache.dtype != dtype:
        raise ValueError(f"compressor: a dense cache must be {dtype}, is {cache.dtype}")


def check_entries_args(
    comp_kv: Tensor,
    pair_state: tuple[Tensor, Tensor] | None,
    read_rows: Tensor | None,
    write_rows: Tensor | None,
    entry_positions: Tensor,
    emit_rows: Tensor,
    src_rows: Tensor | None = None,
) -> int:
    """ValueError unless `compress_entries`' rows agree (its kernel and twin both call this);
    returns D, the entry width."""
    if comp_kv.dim() != 2:
        raise ValueError(f"compress_entries: comp_kv must be [T, *], got {tuple(comp_kv.shape)}")
    t = comp_kv.shape[0]
    if src_rows is not None:
        if src_rows.dim() != 1 or src_rows.dtype not in (torch.int32, torch.int64):
            raise ValueError("compress_entries: src_rows must be a 1-d int32/int64 tensor")
        t = src_rows.shape[0]
    if entry_positions.shape != (t,) or emit_rows.shape != (t,):
        raise ValueError(
            f"compress_entries: entry_positions and emit_rows must be [{t}], got "
            f"{tuple(entry_positions.shape)} and {tuple(emit_rows.shape)}"
        )
    if pair_state is None:
        return int(comp_kv.shape[1])
    if read_rows is None or write_rows is None:
        raise ValueError("compress_entries: ratio 2 needs read_rows and write_rows")
    if read_rows.shape != (t,) or write_rows.shape != (t,):
        raise ValueError(f"compress_entries: read_rows and write_rows must be [{t}]")
    state_kv, state_gate = pair_state
    d = int(state_kv.shape[1])
    if comp_kv.shape[1] != 2 * d or comp_kv.stride(1) != 1:
        raise ValueError(f"compress_entries: comp_kv must be [T, {2 * d}] kv | gate rows")
    if state_gate.shape != state_kv.shape or not state_kv.is_contiguous():
        raise ValueError("compress_entries: the pair state must be two contiguous [S, D]")
    return d


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
    """The kv source's compressor over T rows (§5.2): returns the latents [T, D] in dtype and
    stores the compressed keys `stored_rows(compressed_key(latent), fmt, cache.dtype)` at
    cache[emit_rows] (−1: the row emits nothing). `src_rows` [T]: row t is comp_kv's row
    src_rows[t] (the CP all-gather's rank-major rows in token order, `CPLayout.rerange_index`);
    None: comp_kv is [T, ...] in token order.

    Ratio 2 (`pair_state` = the fp32 (kv, gate) state rows, comp_kv = fp32 kv | gate [T, 2D]):
    row t pools with its partner, the state's row read_rows[t] when >= 0, else row t − 1 (zeros
    above row 0); then every row t with write_rows[t] >= 0 leaves its kv and gate there (after
    the reads). Ratio 1 (`pair_state` None): comp_kv [T, D] is the entry itself."""
    check_store_cache(fmt, cache, dtype)
    d = check_entries_args(
        comp_kv, pair_state, read_rows, write_rows, entry_positions, emit_rows, src_rows
    )
    if src_rows is not None:
        comp_kv = comp_kv.index_select(0, src_rows)
    if pair_state is None:
        pooled = comp_kv
    else:
        assert read_rows is not None and write_rows is not None  # checked above
        state_kv, state_gate = pair_state
        kv, gate = comp_kv[:, :d], comp_kv[:, d:]
        from_state = (read_rows >= 0)[:, None]
        rows = read_rows.clamp(min=0)
        above_kv = torch.cat([torch.zeros_like(kv[:1]), kv[:-1]])
        above_gate = torch.cat([torch.zeros_like(gate[:1]), gate[:-1]])
        partner_kv = torch.where(from_state, state_kv[rows], above_kv)
        partner_gate = torch.where(from_state, state_gate[rows], above_gate)
        pooled = pair_pool(kv, gate, partner_kv, partner_gate)
        _store_at(state_kv, write_rows, kv)
        _store_at(state_gate, write_rows, gate)
    latent = compressed_latent(pooled, norm_weight, eps, dtype)
    key = compressed_key(latent, entry_positions, rope_dim, theta, yarn)
    _store_at(cache, emit_rows, stored_rows(key, fmt, cache.dtype))
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
    """cache[emit_rows] = stored_rows(index_key(latent, ...), fmt, cache.dtype) where emit_rows
    >= 0: the index keys as the index cache keeps them."""
    check_store_cache(fmt, cache, latent.dtype)
    key = index_key(latent, wk, k_norm_weight, eps, entry_positions, rope_dim, theta, yarn)
    _store_at(cache, emit_rows, stored_rows(key, fmt, cache.dtype))
