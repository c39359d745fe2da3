"""The layer's index node over the index-key cache (attention-math §5.3, §7): `mqa_topk_cached`
reads the keys from the cache, the workspace entries' rows decoded once into a dense [N, D_I]
workspace in q.dtype (`index_workspace`, bounded by the batch's entries: 256 B per entry in
bf16), then selects through `indexer_topk.launch_mqa_topk` (the fused scan, or the logits route,
by width and rows: `indexer_topk.pick_route`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4cp.kernels.indexer_topk import launch_mqa_topk
from dsv4cp.kernels.kv_decode import decode_gather
from dsv4cp.ops.kv_format import check_format
from dsv4cp.ops.quant import QuantMode


def mqa_topk_cached(
    q: Tensor,
    weights: Tensor,
    k_cache: Tensor,
    k_rows: Tensor,
    n_visible: Tensor,
    k_top: int,
    *,
    k_start: Tensor | None = None,
    width: int | None = None,
    k_format: str = "dense",
    quant: QuantMode = "none",
    block_size: int = 1,
    max_blocks: int = 0,
    block_ids: Tensor | None = None,
    mean_visible: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Triton twin of ops.indexer_topk.mqa_topk_cached: the workspace entries' index keys decoded
    once into a dense workspace [N, D_I] in q.dtype (`kv_decode.decode_gather`: exact, 256 B per
    entry in bf16 at D_I = 128), then the fused scan, or for a plain top-k over ≤
    LOGITS_ROUTE_MAX_WIDTH keys (or a row per ≤ LOGITS_ROUTE_KEYS_PER_ROW keys) the logits
    route (`launch_mqa_topk`, `pick_route`)."""
    d = q.shape[-1]
    keys = index_workspace(k_cache, k_rows, k_format, d, q.dtype)
    if block_ids is not None and max_blocks:
        raise ValueError("mqa_topk_cached: block_ids (consumer) and max_blocks (source) exclude")
    return launch_mqa_topk(
        q, weights, keys, n_visible, k_top,
        k_start=k_start, width=width, block_ids=block_ids, block_size=block_size,
        max_blocks=max_blocks, quant=quant, route="auto", mean_visible=mean_visible,
    )  # fmt: skip


def index_workspace(
    k_cache: Tensor, k_rows: Tensor, k_format: str, d: int, dtype: torch.dtype
) -> Tensor:
    """The keys of the workspace entries [N, d] in `dtype`, decoded from their cache rows (−1 rows
    read row 0, as the twin does: never visible by contract)."""
    check_format(k_format)
    if k_rows.dim() != 1:
        raise ValueError(f"mqa_topk_cached: k_rows must be [N], got {tuple(k_rows.shape)}")
    out = torch.empty((k_rows.shape[0], d), dtype=dtype, device=k_cache.device)
    return decode_gather(k_cache, k_rows.clamp_min(0), k_format, d, out)
