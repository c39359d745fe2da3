"""Indexer MQA logits read straight from an index-key cache in its storage format.

The keys a batch scores are every request's compressed entries, 0…⌊S/r⌋−1 (`CompressedWorkspace`,
context-sized). Gathering them into a dense workspace would cost D_I floats per entry; here the
op takes the cache rows of those entries (`k_rows`) and reads the stored rows (fp4 + scales at
68 B per entry in `qat`), dequantizing what it scores. The Triton kernel does it on load; this
twin gathers and decodes the rows, then applies `ops.indexer.mqa_logits`.
"""

from __future__ import annotations

from torch import Tensor

from dsv4cp.ops.indexer import mqa_logits
from dsv4cp.ops.kv_format import decode_rows, row_width
from dsv4cp.ops.quant import QuantMode


def mqa_logits_cached(
    q: Tensor,
    weights: Tensor,
    k_cache: Tensor,
    k_rows: Tensor,
    n_visible: Tensor,
    *,
    k_start: Tensor | None = None,
    width: int | None = None,
    k_format: str = "dense",
    quant: QuantMode = "none",
) -> Tensor:
    """`mqa_logits(q, weights, k, n_visible, k_start=, width=, quant=)` with k = the rows
    k_cache[k_rows] decoded from `k_format` (`ops.kv_format`); fp32 [T, width].

    q [T, H_I, D_I], weights [T, H_I], k_cache [N_rows, row] stored rows, k_rows int [N] (the
    cache row of each workspace entry, −1 = none: read as row 0, never visible by contract).
    """
    d = q.shape[-1]
    w = row_width(k_format, d)
    if k_cache.dim() != 2 or k_cache.shape[1] != w or k_rows.dim() != 1:
        raise ValueError(
            f"mqa_logits_cached: k_cache must be [N, {w}] ({k_format}) and k_rows [N], got "
            f"{tuple(k_cache.shape)} and {tuple(k_rows.shape)}"
        )
    keys = decode_rows(k_cache[k_rows.long().clamp_min(0)], k_format, d)
    return mqa_logits(q, weights, keys, n_visible, k_start=k_start, width=width, quant=quant)
