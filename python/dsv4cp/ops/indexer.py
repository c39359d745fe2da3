"""Indexer: queries, head weights, MQA logits and top-k selections (attention-math §5.3).

Selections break exact ties toward the smaller index, on every device.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.functional import pad

from dsv4cp.ops.attention_quant import fake_quant_index_fp4, index_scores_qat
from dsv4cp.ops.matmul import linear_rows
from dsv4cp.ops.quant import QuantMode, check_quant_mode
from dsv4cp.ops.rope import YarnScaling, apply_rope

_NEG_INF = float("-inf")


def check_index_query_proj(q_proj: Tensor, head_dim: int) -> None:
    """ValueError unless q_proj is [T, H_I·head_dim]."""
    if q_proj.dim() != 2 or q_proj.shape[1] % head_dim:
        raise ValueError(
            f"rope_index_queries: q_proj must be [T, H_I*{head_dim}], got {tuple(q_proj.shape)}"
        )


def rope_index_queries(
    q_proj: Tensor,
    positions: Tensor,
    rope_dim: int,
    theta: float,
    yarn: YarnScaling | None = None,
    *,
    head_dim: int,
    quant: QuantMode = "none",
) -> Tensor:
    """Index queries [T, H_I, head_dim] from their projection q_proj [T, H_I·head_dim] (the
    `indexer.wq_b` output): each head's tail roped, in q_proj.dtype; under "qat" then fp4 e2m1
    per 32 with ue8m0 scales, dequantized (reference `Indexer.forward`)."""
    check_index_query_proj(q_proj, head_dim)
    q = apply_rope(q_proj.unflatten(1, (-1, head_dim)), positions, rope_dim, theta, yarn)
    if check_quant_mode(quant) == "qat":
        return fake_quant_index_fp4(q)
    return q


def indexer_weights(x: Tensor, weights_proj: Tensor, *, head_dim: int) -> Tensor:
    """Head weights fp32 [T, H_I] = (x @ Wᵀ) rounded to x.dtype, times D_I^-½ · H_I^-½."""
    n_heads = weights_proj.shape[0]
    w = linear_rows(x, weights_proj.to(x.dtype)).float()
    return w * (head_dim**-0.5 * n_heads**-0.5)


def mqa_logits(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    n_visible: Tensor,
    *,
    k_start: Tensor | None = None,
    width: int | None = None,
    quant: QuantMode = "none",
) -> Tensor:
    """logits[t, j] = Σ_h weights[t,h]·relu(q[t,h]·k[k_start[t]+j]) for j < n_visible[t], else -inf.

    fp32 [T, width]. The caller keeps k_start[t] + n_visible[t] ≤ N (not checked: no host sync).
    "none": fp32 products and sums. "qat": the reference's bf16 order and precision
    (`attention_quant.index_scores_qat`: per head bf16(q·k), relu, bf16(· bf16(w)), heads added
    in order in fp32, one bf16 rounding); q and k are then the fake-fp4 index queries and keys.
    """
    t, h, _ = q.shape
    n = k.shape[0]
    width = n if width is None else width
    if check_quant_mode(quant) == "qat":
        dense = index_scores_qat(q, k, weights)
    else:
        qf, kf, wf = q.float(), k.float(), weights.float()
        dense = torch.zeros(t, n, dtype=torch.float32, device=q.device)
        for head in range(h):  # per head keeps memory at [T, N]; the head order is fixed
            dense = dense + linear_rows(qf[:, head], kf).relu() * wf[:, head, None]
    j = torch.arange(width, device=q.device)
    if n == 0:
        cols = torch.zeros(t, width, dtype=torch.float32, device=q.device)
    elif k_start is None:
        cols = dense[:, :width] if width <= n else pad(dense, (0, width - n))
    else:
        cols = dense.gather(1, (k_start.long()[:, None] + j).clamp(0, n - 1))
    return torch.where(j < n_visible[:, None], cols, _NEG_INF)


def _pick_topk(values: Tensor, eligible: Tensor, k: int) -> Tensor:
    """Indices of the k largest eligible values per row (ties → smaller index), sorted ascending,
    -1 pads last; int32 [T, k]."""
    t, w = values.shape
    kk = min(k, w)
    out = torch.full((t, k), -1, dtype=torch.int64, device=values.device)
    if kk == 0:
        return out.to(torch.int32)
    bits = (values.float() + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0
    order = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # int order == float order
    order = order.clamp_min(-(2**31) + 1).to(torch.int64)
    order = torch.where(eligible, order, -(2**31))
    j = torch.arange(w, device=values.device)
    key = order * 2**31 + (w - 1 - j)  # unique keys: value first, then the smaller index
    picked = key.topk(kk, dim=-1, sorted=False).indices
    picked = torch.where(eligible.gather(1, picked), picked, w)
    picked = picked.sort(dim=-1).values
    out[:, :kk] = torch.where(picked == w, -1, picked)
    return out.to(torch.int32)


def _visible(logits: Tensor, n_visible: Tensor) -> Tensor:
    j = torch.arange(logits.shape[-1], device=logits.device)
    return j < n_visible[:, None]


def topk_indices(logits: Tensor, n_visible: Tensor, k: int) -> Tensor:
    """int32 [T, k]: all j < n if n ≤ k, else the k largest logits over j < n.

    Sorted ascending, -1 pads last; n may be 0.
    """
    return _pick_topk(logits, _visible(logits, n_visible), k)


def candidate_blocks(
    logits: Tensor,
    n_visible: Tensor,
    block_size: int,
    max_blocks: int,
) -> Tensor:
    """Blocks of `block_size` positions scored by their max visible logit, the newest block
    (holding n-1) forced in; top min(max_blocks, #blocks) non -inf ones, ascending, -1 pads."""
    t, w = logits.shape
    n_blocks = -(-w // block_size)
    masked = torch.where(_visible(logits, n_visible), logits.float(), _NEG_INF)
    masked = pad(masked, (0, n_blocks * block_size - w), value=_NEG_INF)
    scores = masked.view(t, n_blocks, block_size).amax(-1)
    newest = torch.div(n_visible.long() - 1, block_size, rounding_mode="floor")
    b = torch.arange(n_blocks, device=logits.device)
    forced = (b == newest[:, None]) & (n_visible[:, None] > 0)
    scores = torch.where(forced, float("inf"), scores)
    return _pick_topk(scores, scores > _NEG_INF, max_blocks)


def topk_among_blocks(
    logits: Tensor,
    n_visible: Tensor,
    block_ids: Tensor,
    block_size: int,
    k: int,
) -> Tensor:
    """Top-k of logits restricted to the listed blocks (-1 ids ignored) and j < n; only finite
    candidates are returned (fewer than k → -1 pads). int32 [T, k], ascending."""
    t, w = logits.shape
    n_blocks = -(-w // block_size)
    ids = block_ids.long()
    ids = torch.where((ids >= 0) & (ids < n_blocks), ids, n_blocks)  # column n_blocks = discard
    member = torch.zeros(t, n_blocks + 1, dtype=torch.bool, device=logits.device)
    member = member.scatter(1, ids, True)[:, :n_blocks]
    j = torch.arange(w, device=logits.device)
    in_blocks = member[:, torch.div(j, block_size, rounding_mode="floor")]
    eligible = in_blocks & _visible(logits, n_visible) & (logits > _NEG_INF)
    return _pick_topk(logits, eligible, k)
