"""The prepare of one V4.1 attention layer: node functions and the schedule of each layer role.

Lanes: `default` (projections, the CP gathers, logits/top-k), `q` (Q chain) and `indexer`
(indexer queries and head weights), both compute-only and forked before the gathers so they
overlap them; `swa` (store_swa_k) and `compressor` (pool/norm/RoPE/store + index K), forked
after the gathers. Everything joins before the MQA logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dsv4cp.cp.group import gather_global
from dsv4cp.routing import (
    candidate_blocks,
    compressed_key,
    compressed_latent,
    index_key,
    indexer_queries,
    indexer_weights,
    linear_fp32,
    mqa_logits,
    pair_pool,
    rms_norm,
    rope_tail_,
    store_swa_k,
    topk_among_blocks,
    topk_indices,
)
from dsv4cp.schedule import Fork, Join, Node, PrepareState, Release, Schedule

if TYPE_CHECKING:
    from dsv4cp.attention import DeepseekV41Attention


LOGITS_BUDGET_BYTES = 256 << 20  # fp32 logits per row chunk of the MQA logits


# ---------------------------------------------------------------------- node functions
def qkv_a(attn: DeepseekV41Attention, st: PrepareState) -> None:
    qkv = F.linear(st["x"], attn.wqkv_a)
    rq = attn.config.q_lora_rank
    st["q_raw"], st["kv_raw"] = qkv[:, :rq], qkv[:, rq:]


def compressor_proj(attn: DeepseekV41Attention, st: PrepareState) -> None:
    x = st["x"]
    if attn.role.ratio == 2:
        # kv | gate in fp32: one gather carries both (4 KiB/token at D = 512).
        st["comp_kv"] = linear_fp32(x, attn.comp_wkv)
    else:
        st["comp_kv"] = F.linear(x, attn.comp_wkv)


def q_norm(attn: DeepseekV41Attention, st: PrepareState) -> None:
    st["q_lora"] = rms_norm(st["q_raw"], attn.q_norm, attn.eps)


def q_chain(attn: DeepseekV41Attention, st: PrepareState) -> None:
    local = st.ctx.local
    q = F.linear(st["q_lora"], attn.wq_b).view(-1, attn.n_heads, attn.head_dim)
    st["q"] = rope_tail_(q, local.positions, attn.rope_dim, attn.theta, attn.yarn)


def indexer_qw(attn: DeepseekV41Attention, st: PrepareState) -> None:
    local = st.ctx.local
    st["idx_q"] = indexer_queries(
        st["q_lora"],
        attn.idx_wq_b,
        local.positions,
        attn.rope_dim,
        attn.theta,
        attn.yarn,
        head_dim=attn.index_dim,
    )
    st["idx_w"] = indexer_weights(st["x"], attn.idx_weights_proj, head_dim=attn.index_dim)


def gather_kv(attn: DeepseekV41Attention, st: PrepareState) -> None:
    ctx = st.ctx
    tag = f"layer{attn.layer}/kv_raw"
    st["kv_raw_g"] = gather_global(ctx.cp, ctx.layout, st["kv_raw"], tag=tag)


def gather_comp(attn: DeepseekV41Attention, st: PrepareState) -> None:
    ctx = st.ctx
    tag = f"layer{attn.layer}/comp_kv"
    st["comp_kv_g"] = gather_global(ctx.cp, ctx.layout, st["comp_kv"], tag=tag)


def swa_store(attn: DeepseekV41Attention, st: PrepareState) -> None:
    ctx = st.ctx
    tok = ctx.meta.tokens
    cache = ctx.cache.swa_cache(attn.layer)
    store_swa_k(
        st["kv_raw_g"],
        tok.positions,
        tok.slots,
        cache,
        attn.kv_norm,
        attn.eps,
        attn.rope_dim,
        attn.theta,
        attn.yarn,
    )
    st["swa_cache"] = cache


def compressor(attn: DeepseekV41Attention, st: PrepareState) -> None:
    """Every rank runs the same compressor over the same global rows (state never travels)."""
    ctx = st.ctx
    tok = ctx.meta.tokens
    cache = ctx.cache
    r, d = attn.role.ratio, attn.head_dim
    g = st["comp_kv_g"]
    if r == 2:
        kv, gate = g[:, :d], g[:, d:]
        from_state = tok.pair_partner_from_state()[:, None]
        read = tok.pair_state_read_slots()
        prev_kv = torch.cat([kv[:1], kv[:-1]])
        prev_gate = torch.cat([gate[:1], gate[:-1]])
        partner_kv = torch.where(from_state, cache.pair_kv[attn.layer][read], prev_kv)
        partner_gate = torch.where(from_state, cache.pair_gate[attn.layer][read], prev_gate)
        pooled = pair_pool(kv, gate, partner_kv, partner_gate)
        write = tok.pair_state_write_slots()
        cache.pair_kv[attn.layer][write] = kv
        cache.pair_gate[attn.layer][write] = gate
    else:
        pooled = g
    latent = compressed_latent(pooled, attn.comp_norm, attn.eps, attn.dtype)
    entry_pos = tok.entry_positions(r)
    emit = tok.emit_slots(r)
    ckey = compressed_key(latent, entry_pos, attn.rope_dim, attn.theta, attn.yarn)
    cache.comp_cache(attn.layer)[emit] = ckey.to(cache.dtype)
    ikey = index_key(
        latent,
        attn.idx_wk,
        attn.idx_k_norm,
        attn.eps,
        entry_pos,
        attn.rope_dim,
        attn.theta,
        attn.yarn,
    )
    index_cache = cache.index_k[attn.layer]
    index_cache[emit] = ikey.to(index_cache.dtype)
    ws = index_cache[ctx.meta.workspaces[r].slots]
    ctx.cross.index_k_ws[r] = ws
    st["comp_cache"] = cache.comp_cache(attn.layer)
    st["index_k_ws"] = ws


def logits_topk(attn: DeepseekV41Attention, st: PrepareState) -> None:
    """Local index queries × the ratio's index-K workspace → top-k (and candidates)."""
    ctx = st.ctx
    r = attn.role.ratio
    local = ctx.local
    ws_meta = ctx.meta.workspaces[r]
    keys = ctx.cross.index_k_ws[r]
    n_vis = local.n_visible(r)
    k_start = ctx.workspace_start(r)
    width = max(ws_meta.max_entries, 1)
    rows = local.num_rows
    chunk = max(1, min(rows, LOGITS_BUDGET_BYTES // (4 * width)))
    cfg = attn.config
    topk_parts, cand_parts = [], []
    for a in range(0, rows, chunk):
        b = min(rows, a + chunk)
        logits = mqa_logits(
            st["idx_q"][a:b],
            st["idx_w"][a:b],
            keys,
            n_vis[a:b],
            k_start=k_start[a:b],
            width=width,
        )
        if attn.role.candidate_consumer:
            blocks = ctx.cross.candidates[r][a:b]
            topk_parts.append(
                topk_among_blocks(
                    logits, n_vis[a:b], blocks, cfg.candidate_block_size, cfg.index_topk
                )
            )
        else:
            topk_parts.append(topk_indices(logits, n_vis[a:b], cfg.index_topk))
        if attn.role.candidate_source:
            cand_parts.append(
                candidate_blocks(
                    logits, n_vis[a:b], cfg.candidate_block_size, cfg.candidate_topk_blocks
                )
            )
    topk = torch.cat(topk_parts)
    ctx.cross.topk[r] = topk
    if cand_parts:
        ctx.cross.candidates[r] = torch.cat(cand_parts)
    st["topk"] = topk


# ---------------------------------------------------------------------- schedules
def build_schedule(attn: DeepseekV41Attention, *, overlap_gathers: bool = True) -> Schedule:
    """The one description of a layer's prepare; executors in `schedule` run it.

    `overlap_gathers=False` forks the compute-only lanes after the gathers instead of before
    them: used when gathers are eager graph breaks (`graphs.runner.EagerBreakCPGroup`), since
    a break may not sit inside an open fork.
    """
    role = attn.role

    def node(fn, reads, writes, lane="default", collective=False) -> Node:  # noqa: ANN001
        return Node(
            fn.__name__, lambda st, f=fn: f(attn, st), tuple(reads), tuple(writes), lane, collective
        )

    kv_src = role.owns_compressor
    idx = role.index_source
    steps: list = [node(qkv_a, ["x"], ["q_raw", "kv_raw"])]
    if kv_src:
        steps.append(node(compressor_proj, ["x"], ["comp_kv"]))
    steps.append(node(q_norm, ["q_raw"], ["q_lora"]))
    q_lanes: list = [Fork(("q", "indexer") if idx else ("q",), compute_only=True)]
    q_lanes.append(node(q_chain, ["q_lora"], ["q"], lane="q"))
    if idx:
        q_lanes.append(node(indexer_qw, ["q_lora", "x"], ["idx_q", "idx_w"], lane="indexer"))
    gathers = [node(gather_kv, ["kv_raw"], ["kv_raw_g"], collective=True)]
    if kv_src:
        gathers.append(node(gather_comp, ["comp_kv"], ["comp_kv_g"], collective=True))
    steps += q_lanes + gathers if overlap_gathers else gathers + q_lanes
    side = ("swa", "compressor") if kv_src else ("swa",)
    steps.append(Fork(side))
    steps.append(node(swa_store, ["kv_raw_g"], ["swa_cache"], lane="swa"))
    if kv_src:
        steps.append(
            node(compressor, ["comp_kv_g"], ["comp_cache", "index_k_ws"], lane="compressor")
        )
    steps.append(Join(("q", "indexer", *side) if idx else ("q", *side)))
    if idx:
        steps.append(node(logits_topk, ["idx_q", "idx_w"], ["topk"]))
    released = ["q_raw", "kv_raw", "kv_raw_g", "q_lora"]
    if kv_src:
        released += ["comp_kv", "comp_kv_g"]
    if idx:
        released += ["idx_q", "idx_w"]
    steps.append(Release(tuple(released)))
    outputs = ("q", "swa_cache") + (("topk",) if idx else ())
    name = f"layer{role.layer}:{role.name}" + ("" if overlap_gathers else ":gathers-first")
    return Schedule(name, tuple(steps), ("x",), outputs)
