"""Indexer logits and their selections in one call: the compositions the fused kernels reproduce.

Each function is `mqa_logits` followed by the selection the layer makes from it (attention-math
§5.3): the full top-k (`mqa_topk`), the top-k plus the candidate-source layer's published blocks
(`mqa_topk_candidates`), and a candidate consumer's top-k among its published blocks
(`mqa_topk_among_blocks`). Rows are independent, so they are done in chunks whose fp32 logits fit
`LOGITS_BUDGET_BYTES`; the result does not depend on the chunking. The Triton twins
(`dsv4cp.kernels.indexer_topk`) never write the [rows, width] logits to memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dsv4cp.ops.indexer import candidate_blocks, mqa_logits, topk_among_blocks, topk_indices

LOGITS_BUDGET_BYTES = 256 << 20  # fp32 logits of one row chunk


def _chunked(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    n_visible: Tensor,
    k_start: Tensor | None,
    width: int | None,
    select: Callable[[Tensor, slice], list[Tensor]],
) -> list[Tensor]:
    """Per row chunk: logits, then `select(logits, rows)`; the parts concatenated per output."""
    t = q.shape[0]
    w = k.shape[0] if width is None else width
    step = max(1, min(t, LOGITS_BUDGET_BYTES // max(1, 4 * w)))
    parts: list[list[Tensor]] = []
    for a in range(0, max(t, 1), step):  # one (empty) chunk when t == 0 shapes empty outputs
        rows = slice(a, min(t, a + step))
        ks = None if k_start is None else k_start[rows]
        logits = mqa_logits(q[rows], weights[rows], k, n_visible[rows], k_start=ks, width=width)
        parts.append(select(logits, rows))
    return [torch.cat(p) for p in zip(*parts)]


def mqa_topk(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    n_visible: Tensor,
    k_top: int,
    *,
    k_start: Tensor | None = None,
    width: int | None = None,
) -> Tensor:
    """topk_indices(mqa_logits(q, weights, k, n_visible, k_start=, width=), n_visible, k_top).

    int32 [T, k_top]: all j < n when n ≤ k_top, else the k_top largest logits (ties → smaller
    j), ascending, -1 pads last.
    """
    (out,) = _chunked(
        q, weights, k, n_visible, k_start, width,
        lambda logits, rows: [topk_indices(logits, n_visible[rows], k_top)],
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

    top, blocks = _chunked(q, weights, k, n_visible, k_start, width, select)
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
) -> Tensor:
    """A candidate consumer's selection: topk_among_blocks(mqa_logits(...), n_visible, block_ids,
    block_size, k_top), int32 [T, k_top]; only finite logits of the listed blocks (-1 and
    out-of-range ids ignored) with j < n are candidates, ascending, -1 pads."""
    (out,) = _chunked(
        q, weights, k, n_visible, k_start, width,
        lambda logits, rows: [
            topk_among_blocks(logits, n_visible[rows], block_ids[rows], block_size, k_top)
        ],
    )  # fmt: skip
    return out
