"""SGLang 0.5.23's Hopper V4.1 attention path, rebuilt from its parts for benchmarks/layer_peer.py.

What SGLang runs for a V4.1 prefill on an H200 (attention-math §10; cp-multistream-bcg.md §3):
the fused c1/c2 compressor kernels and DeepGEMM's fp4 index scores need SM100, so the indexer
takes its torch path — per request, bf16 `einsum("bhd,nd->bhn")` scores over the request's index
keys in row chunks of ≤ 1 GiB, relu, times the bf16 head weights, summed over heads, cast to fp32,
−inf past each row's visible count, then `torch.topk` (unsorted) and a sort; the candidate source
scores blocks of 8 by their max with the newest block forced in and keeps the top 2048 with
`torch.topk`; a consumer gathers its published blocks' scores and takes `torch.topk` among them.
Attention is FlashMLA's sparse prefill (`flash_mla_sparse_fwd`, legacy SM90 kernels) over a bf16
workspace into which SGLang dequantizes the request's SWA window rows (every layer) and its
compressed entries (once per kv source). Written from that description and from reading
`srt/layers/attention/dsv4/v41_indexer/{scoring,full_topk,dense_blocks}.py` and
`kernels/ops/attention/dsv4/candidate_blocks.py`; no code is taken from them.

The functions here replace the dsv4cp layer's indexer node and sparse attention call, so the rest
of the peer's layer (projection GEMMs, cache writes, compressor) is dsv4cp's own: the same GEMMs,
and memory-bound work at least as fast as SGLang's (whose V4.1 compressor is torch on Hopper).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

SCORE_BUDGET_BYTES = 1 << 30  # SGLang's torch score budget per chunk ([rows, heads, lc] bf16)
FLASHMLA_TOPK_ALIGN = 64


def score_chunks(
    q: Tensor, weights: Tensor, keys: Tensor, lens: Tensor
) -> Iterator[tuple[slice, Tensor]]:
    """(rows, fp32 scores [rows, lc]) per row chunk: bf16 einsum, relu, bf16 head weights,
    head sum, −inf where j ≥ lens. `keys` are the request's first lc index keys."""
    lc = keys.shape[0]
    if keys.is_cuda and keys.dtype == torch.bfloat16 and lc >= 1024:
        keys = F.pad(keys, (0, 0, 0, -lc % 64))  # SGLang pads K once per request to 64 rows
    heads = q.shape[1]
    step = max(1, SCORE_BUDGET_BYTES // (heads * keys.shape[0] * 2))
    w = weights.to(q.dtype)
    j = torch.arange(lc, device=q.device)
    for a in range(0, q.shape[0], step):
        rows = slice(a, a + step)
        s = torch.einsum("bhd,nd->bhn", q[rows], keys)
        s = (s.relu() * w[rows, :, None]).sum(dim=1).float()[:, :lc]
        yield rows, s.masked_fill(j[None, :] >= lens[rows, None], float("-inf"))


def candidate_block_ids(scores: Tensor, lens: Tensor, topk_blocks: int, block_size: int) -> Tensor:
    """The source's published blocks: top `topk_blocks` blocks by max score, the block holding
    lens − 1 forced in, −1 for blocks with no finite score; int32, unordered."""
    padded = F.pad(scores, (0, -scores.shape[1] % block_size), value=float("-inf"))
    block_max = padded.view(scores.shape[0], -1, block_size).amax(dim=-1)
    nb = block_max.shape[1]
    newest = torch.div(lens - 1, block_size, rounding_mode="floor")
    block_max = block_max.masked_fill(
        torch.arange(nb, device=scores.device)[None, :] == newest[:, None], float("inf")
    )
    top = block_max.topk(min(topk_blocks, nb), dim=-1)
    return top.indices.to(torch.int32).masked_fill(top.values == float("-inf"), -1)


def topk_in_blocks(scores: Tensor, lens: Tensor, blocks: Tensor, k: int, block_size: int) -> Tensor:
    """A consumer's top-k positions among its published blocks (and j < lens), −1 past the
    finite candidates; int64 [rows, k], unordered."""
    rows = scores.shape[0]
    padded = F.pad(scores, (0, -scores.shape[1] % block_size), value=float("-inf"))
    nb = padded.shape[1] // block_size
    ids = blocks.long()
    per_block = padded.view(rows, nb, block_size).gather(
        1, ids.clamp(0, nb - 1)[:, :, None].expand(-1, -1, block_size)
    )
    offset = torch.arange(block_size, device=scores.device)
    outside = offset[None, None, :] >= (lens[:, None] - ids * block_size)[:, :, None]
    per_block = per_block.masked_fill(outside | (ids < 0)[:, :, None], float("-inf"))
    flat = per_block.flatten(1)
    top = flat.topk(min(k, flat.shape[1]), dim=-1, sorted=False)
    pos = ids.gather(1, top.indices // block_size) * block_size + top.indices % block_size
    pos = pos.masked_fill(top.values == float("-inf"), -1)
    return F.pad(pos, (0, k - pos.shape[1]), value=-1)


def peer_logits_topk(layer: Any, st: Any) -> None:
    """Stands in for `DeepseekV41Attention._logits_topk` (one request per batch, as in the
    benchmark): SGLang's torch indexer, writing the same cross-layer records."""
    ctx = st.ctx
    cfg, r = layer.config, layer.role.ratio
    lens = ctx.local.n_visible(r)
    lc = int(lens.max().item())  # the host read SGLang makes per request
    t, k_top = lens.shape[0], cfg.index_topk
    topk = torch.full((t, k_top), -1, dtype=torch.int32, device=lens.device)
    published = torch.full(
        (t, cfg.candidate_topk_blocks), -1, dtype=torch.int32, device=lens.device
    )
    if lc > 0:
        src = layer.role.kv_source
        rows = ctx.cache.entry_rows(r, ctx.meta.workspaces[r].slots[:lc])
        keys = ctx.cache.decode("index", ctx.cache.index[src][rows]).to(ctx.cache.dtype)
        k = min(k_top, lc)
        for rows, s in score_chunks(st["idx_q"], st["idx_w"], keys, lens):
            if layer.role.candidate_consumer:
                blocks = ctx.cross.candidates[r][rows]
                idx = topk_in_blocks(s, lens[rows], blocks, k, cfg.candidate_block_size)
                idx = idx.masked_fill(idx < 0, lc)
            else:
                idx = s.topk(k, dim=-1, sorted=False).indices
            if layer.role.candidate_source:
                ids = candidate_block_ids(
                    s, lens[rows], cfg.candidate_topk_blocks, cfg.candidate_block_size
                )
                published[rows, : ids.shape[1]] = ids
            idx = idx.sort(dim=-1).values
            topk[rows, :k] = torch.where(idx < lens[rows, None], idx, -1).to(torch.int32)
    ctx.cross.topk[r] = topk
    if layer.role.candidate_source:
        ctx.cross.candidates[r] = published
    st["topk"] = topk


def flashmla_sparse_attention(
    q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float
) -> Tensor:
    """FlashMLA's sparse prefill as SGLang calls it on SM90 (legacy kernels), on a bf16 kv."""
    import flash_mla

    idx = indices.to(torch.int32)
    idx = F.pad(idx, (0, -idx.shape[1] % FLASHMLA_TOPK_ALIGN), value=-1)
    out, _, _ = flash_mla.flash_mla_sparse_fwd(
        q.contiguous(),
        kv.unsqueeze(1),
        idx.contiguous().unsqueeze(1),
        float(scale),
        kv.shape[1],
        attn_sink=sink.float(),
        use_legacy=torch.cuda.get_device_capability(q.device)[0] == 9,
    )
    return out


def workspace_rows(layer: Any, ctx: Any) -> tuple[Tensor, Tensor | None]:
    """Cache rows SGLang dequantizes into its bf16 workspace for this layer: the request's rows
    of the layer's SWA cache from the first window position to the chunk's end (every layer),
    and, on a kv source, every compressed entry of the request in its compressed cache (shared
    by the layers reading that source)."""
    cache, meta = ctx.cache, ctx.meta
    tok = meta.tokens
    first = int(tok.start[0].item())
    end = int(tok.end[0].item())
    lo = max(0, first - layer.window + 1)
    pos = torch.arange(lo, end, device=cache.device)
    swa = cache.swa_rows(cache.req_to_token[int(tok.req_row[0].item()), pos])
    comp = None
    if layer.role.owns_compressor:
        r = layer.role.ratio
        comp = cache.entry_rows(r, meta.workspaces[r].slots)
    return swa, comp
