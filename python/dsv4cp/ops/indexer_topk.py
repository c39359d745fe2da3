"""Indexer logits and their selections in one call: the compositions the fused kernels reproduce.

Each function is `mqa_logits` followed by the selection the layer makes from it (attention-math
§5.3): the full top-k (`mqa_topk`), the top-k plus the candidate-source layer's published blocks
(`mqa_topk_candidates`), and a candidate consumer's top-k among its published blocks
(`mqa_topk_among_blocks`). Rows are independent, so they are done in chunks whose fp32 logits fit
`LOGITS_BUDGET_BYTES`; the result does not depend on the chunking. The Triton twins
(`dsv4cp.kernels.indexer_topk`) never write the [rows, width] logits to memory, but for a
plain top-k over ≤ 8K keys or with at least one row per 4 keys, which they compose as here
(`pick_route`). `quant` is
`mqa_logits`'s: "qat" selects from the reference's bf16 index scores.

`mqa_topk_cached` is the layer's one call: the keys are rows of the index-key cache in their
storage format (as `mqa_logits_cached` reads them), and the selection is the layer role's (full
top-k, + candidate blocks for the candidate source, among the published blocks for a consumer).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dsv4cp.ops.indexer import candidate_blocks, mqa_logits, topk_among_blocks, topk_indices
from dsv4cp.ops.kv_format import decode_rows, row_width
from dsv4cp.ops.quant import QuantMode

LOGITS_BUDGET_BYTES = 256 << 20  # fp32 logits of one row chunk


def row_chunks(t: int, width: int) -> list[slice]:
    """The row chunks of `t` rows whose fp32 logits [rows, width] fit LOGITS_BUDGET_BYTES (none
    when t == 0)."""
    step = max(1, min(t, LOGITS_BUDGET_BYTES // max(1, 4 * width)))
    return [slice(a, min(t, a + step)) for a in range(0, t, step)]


def in_row_chunks(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    n_visible: Tensor,
    k_start: Tensor | None,
    width: int | None,
    select: Callable[[Tensor, slice], list[Tensor]],
    quant: QuantMode = "none",
    logits_fn: Callable[..., Tensor] = mqa_logits,
) -> list[Tensor]:
    """Per row chunk whose fp32 logits fit LOGITS_BUDGET_BYTES: `logits_fn` (`mqa_logits`, or
    its kernel twin: the kernels' logits route), then `select(logits, rows)`; the parts
    concatenated per output (one chunk's parts as they are)."""
    t = q.shape[0]
    w = k.shape[0] if width is None else width
    parts: list[list[Tensor]] = []
    for rows in row_chunks(t, w) or [slice(0, 0)]:  # an empty chunk shapes empty outputs
        ks = None if k_start is None else k_start[rows]
        logits = logits_fn(
            q[rows], weights[rows], k, n_visible[rows], k_start=ks, width=width, quant=quant
        )
        parts.append(select(logits, rows))
    return [p[0] if len(p) == 1 else torch.cat(p) for p in zip(*parts)]


def mqa_topk(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    n_visible: Tensor,
    k_top: int,
    *,
    k_start: Tensor | None = None,
    width: int | None = None,
    quant: QuantMode = "none",
) -> Tensor:
    """topk_indices(mqa_logits(q, weights, k, n_visible, k_start=, width=), n_visible, k_top).

    int32 [T, k_top]: all j < n when n ≤ k_top, else the k_top largest logits (ties → smaller
    j), ascending, -1 pads last.
    """
    (out,) = in_row_chunks(
        q, weights, k, n_visible, k_start, width,
        lambda logits, rows: [topk_indices(logits, n_visible[rows], k_top)], quant,
    )  # fmt: skip
    return out


def mqa_topk_candidates(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    n_visible: Tensor,
    k_top: int,
    block_size: int,
    max_blocks: int,
    *,
    k_start: Tensor | None = None,
    width: int | None = None,
    quant: QuantMode = "none",
) -> tuple[Tensor, Tensor]:
    """The candidate source's selections from one set of logits: (mqa_topk(...),
    candidate_blocks(logits, n_visible, block_size, max_blocks)), int32 [T, k_top] and
    [T, max_blocks]."""

    def select(logits: Tensor, rows: slice) -> list[Tensor]:
        nv = n_visible[rows]
        return [
            topk_indices(logits, nv, k_top),
            candidate_blocks(logits, nv, block_size, max_blocks),
        ]

    top, blocks = in_row_chunks(q, weights, k, n_visible, k_start, width, select, quant)
    return top, blocks


def mqa_topk_among_blocks(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    n_visible: Tensor,
    block_ids: Tensor,
    block_size: int,
    k_top: int,
    *,
    k_start: Tensor | None = None,
    width: int | None = None,
    quant: QuantMode = "none",
) -> Tensor:
    """A candidate consumer's selection: topk_among_blocks(mqa_logits(...), n_visible, block_ids,
    block_size, k_top), int32 [T, k_top]; only finite logits of the listed blocks (-1 and
    out-of-range ids ignored) with j < n are candidates, ascending, -1 pads."""
    (out,) = in_row_chunks(
        q, weights, k, n_visible, k_start, width,
        lambda logits, rows: [
            topk_among_blocks(logits, n_visible[rows], block_ids[rows], block_size, k_top)
        ],
        quant,
    )  # fmt: skip
    return out


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
    """An index layer's selection from the index-key cache: (top-k int32 [T, k_top], candidate
    blocks int32 [T, max_blocks] or None). `mean_visible` picks the kernel's consumer mode
    (`kernels.indexer_topk_plan.plan_gather`); the twin has one mode and ignores it.

    The keys are k_cache[k_rows] decoded from `k_format` (k_rows int [N]: the cache row of each
    workspace entry, −1 read as row 0 and never visible by contract), scored as `mqa_logits`
    with `quant`. `block_ids` given (a candidate consumer): `mqa_topk_among_blocks`; else
    `max_blocks` > 0 (the candidate source): `mqa_topk_candidates`; else `mqa_topk`.
    """
    d = q.shape[-1]
    w = row_width(k_format, d)
    if k_cache.dim() != 2 or k_cache.shape[1] != w or k_rows.dim() != 1:
        raise ValueError(
            f"mqa_topk_cached: k_cache must be [N, {w}] ({k_format}) and k_rows [N], got "
            f"{tuple(k_cache.shape)} and {tuple(k_rows.shape)}"
        )
    if block_ids is not None and max_blocks:
        raise ValueError("mqa_topk_cached: block_ids (consumer) and max_blocks (source) exclude")
    keys = decode_rows(k_cache[k_rows.long().clamp_min(0)], k_format, d)
    if block_ids is not None:
        top = mqa_topk_among_blocks(
            q, weights, keys, n_visible, block_ids, block_size, k_top,
            k_start=k_start, width=width, quant=quant,
        )  # fmt: skip
        return top, None
    if max_blocks:
        return mqa_topk_candidates(
            q, weights, keys, n_visible, k_top, block_size, max_blocks,
            k_start=k_start, width=width, quant=quant,
        )  # fmt: skip
    top = mqa_topk(q, weights, keys, n_visible, k_top, k_start=k_start, width=width, quant=quant)
    return top, None
