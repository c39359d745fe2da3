"""Engram: fp8 hash-table rows looked up on the host, projected, and gated into the streams.

DeepSeek reference ``model.py`` (``ParallelEngramEmbedding.forward``, ``Engram.forward``):

- rows: each hash id picks one ``head_dim`` row of the layer's fp8 e4m3 table, dequantized with
  its e8m0 scale per 32 channels (exact in bf16);
- kv = wkv(concat of the (N-1)·n_heads rows) → ``hc_mult`` keys and one value, each ``d`` wide;
- per stream i: dot = Σ_c x_i·(q_w·k_w)_i·key_i · rsqrt(mean x_i² + ε) · rsqrt(mean key_i² + ε)
  / √d (each stream normalised on its own, ε = ``rms_norm_eps``), gate = sigmoid(sign(dot) ·
  √max(|dot|, 1e-6)), and x_i += gate · value, in fp32, rounded to x.dtype;
- a position whose token_mask is False (an image token) keeps its streams unchanged.

The tables are large (189 GiB in the release), so ``gather_table_rows`` reads only the distinct
looked-up rows from a host tensor or a numpy memmap of the shard and moves only those.
"""

from __future__ import annotations

from typing import Union

import numpy as np
import torch
from torch import Tensor

from dsv4cp.ops.linear import linear
from dsv4cp.ops.quant import QuantMode, check_quant_mode

RowSource = Union[Tensor, np.ndarray]  # a numpy.memmap is an np.ndarray
_GATE_FLOOR = 1e-6  # |dot| floor before the signed sqrt (reference `clamp_value`)
_NP_VIEW = {torch.float8_e4m3fn: np.uint8, torch.float8_e8m0fnu: np.uint8}


def _rows_from(source: RowSource, ids: Tensor, dtype: torch.dtype | None) -> Tensor:
    if isinstance(source, Tensor):
        return source[ids.to(source.device)]
    rows = torch.from_numpy(np.ascontiguousarray(source[ids.cpu().numpy()]))
    if dtype is not None and rows.dtype != dtype:
        if _NP_VIEW.get(dtype) != source.dtype:
            raise ValueError(
                f"a numpy row source of dtype {source.dtype} cannot be read as {dtype}"
            )
        rows = rows.view(dtype)
    return rows


def gather_table_rows(
    source: RowSource,
    ids: Tensor,
    *,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """(distinct rows on ``device`` [U, ...], inverse [ids.shape] into them).

    ``source`` is a host (or device) tensor or a numpy array / memmap ``[rows, ...]``; only the U
    distinct ids are read and moved. ``dtype`` reinterprets the bytes of a numpy source (uint8
    memmaps of fp8 / e8m0 data).
    """
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"table ids must be int32/int64, got {ids.dtype}")
    n_rows = source.shape[0]
    uniq, inverse = torch.unique(ids.flatten(), return_inverse=True)
    if uniq.numel() and (int(uniq[0]) < 0 or int(uniq[-1]) >= n_rows):
        raise ValueError(
            f"table ids must lie in [0, {n_rows}), got [{int(uniq[0])}, {int(uniq[-1])}]"
        )
    rows = _rows_from(source, uniq, dtype).to(device, non_blocking=True)
    return rows, inverse.view(ids.shape).to(device)


def lookup_fp8_rows(
    weight: RowSource,
    scale: RowSource,
    ids: Tensor,
    *,
    device: torch.device | str,
    out_dtype: torch.dtype,
    block: int = 32,
) -> Tensor:
    """Dequantized table rows ``[*ids.shape, head_dim]`` in out_dtype: fp8 e4m3 codes times the
    row's e8m0 scale per ``block`` channels (exact in bf16 and fp32)."""
    codes, inverse = gather_table_rows(weight, ids, device=device, dtype=torch.float8_e4m3fn)
    scales, _ = gather_table_rows(scale, ids, device=device, dtype=torch.float8_e8m0fnu)
    head_dim = codes.shape[-1]
    if head_dim % block or tuple(scales.shape[1:]) != (head_dim // block,):
        raise ValueError(
            f"table scale rows must be [{head_dim // block}] for head_dim {head_dim}"
            f" and block {block}, got {tuple(scales.shape[1:])}"
        )
    rows = codes.float().unflatten(-1, (-1, block)) * scales.float().unsqueeze(-1)
    return rows.flatten(-2).to(out_dtype)[inverse]


def engram_gate_update(
    x: Tensor,
    kv: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    *,
    norm_eps: float,
    token_mask: Tensor | None = None,
) -> Tensor:
    """Streams x [T, H, d] plus the gated value, per stream; kv [T, (H+1)·d] = H keys, 1 value."""
    t, hc, d = x.shape
    if kv.shape != (t, (hc + 1) * d):
        raise ValueError(f"engram kv must be [{t}, {(hc + 1) * d}], got {tuple(kv.shape)}")
    if q_weight.shape != (hc, d) or k_weight.shape != (hc, d):
        raise ValueError(
            f"engram q_weight/k_weight must be [{hc}, {d}], got "
            f"{tuple(q_weight.shape)} / {tuple(k_weight.shape)}"
        )
    key = kv[:, : hc * d].float().unflatten(-1, (hc, d))
    value = kv[:, hc * d :].float()
    h = x.float()
    rstd = torch.rsqrt(h.square().mean(-1) + norm_eps) * torch.rsqrt(
        key.square().mean(-1) + norm_eps
    )
    dot = (h * (q_weight.float() * k_weight.float()) * key).sum(-1) * rstd * d**-0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(_GATE_FLOOR).sqrt(), dot))
    if token_mask is not None:
        gate = gate.masked_fill(~token_mask.unsqueeze(-1), 0)
    return (h + gate.unsqueeze(-1) * value.unsqueeze(-2)).to(x.dtype)


def engram(
    x: Tensor,
    hash_ids: Tensor,
    *,
    table_weight: RowSource,
    table_scale: RowSource,
    wkv: tuple[Tensor, Tensor | None],
    q_weight: Tensor,
    k_weight: Tensor,
    norm_eps: float,
    quant: QuantMode,
    token_mask: Tensor | None = None,
) -> Tensor:
    """One Engram layer: streams x [T, H, d] and this layer's hash ids [T, cols] → [T, H, d]."""
    quant = check_quant_mode(quant)
    if hash_ids.dim() != 2 or hash_ids.shape[0] != x.shape[0]:
        raise ValueError(f"hash_ids must be [{x.shape[0]}, cols], got {tuple(hash_ids.shape)}")
    rows = lookup_fp8_rows(table_weight, table_scale, hash_ids, device=x.device, out_dtype=x.dtype)
    kv = linear(rows.flatten(-2), *wkv, quant)
    return engram_gate_update(x, kv, q_weight, k_weight, norm_eps=norm_eps, token_mask=token_mask)
