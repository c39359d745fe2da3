"""`DeepseekV41Attention`: one V4.1 attention sub-layer on one CP rank, in one file.

Read top to bottom: the weights (DeepSeek's checkpoint names as views); the prepare, one method
per schedule node, each reading and writing named buffers of a `PrepareState`; `schedule()`, the
DAG those nodes form for this layer's role; and `forward` = prepare → sparse attention →
inverse RoPE → `wo_a` → `wo_b` (attention-math §4.2–§4.7, §5). The reference is DeepSeek's
`model.py` (`Attention.forward`, `Compressor.forward`, `Indexer.forward`,
`select_candidate_blocks`), rewritten here for CP ranks and slot-indexed caches.

Lanes of the prepare: `default` (projections, the CP gathers, logits/top-k); `q` (the Q chain)
and `indexer` (indexer queries and head weights), compute-only and forked before the gathers so
they overlap them; `swa` (the SWA key store) and `compressor` (pool/norm/RoPE/store + index K),
forked after the gathers. Everything joins before the MQA logits (docs/invariants.md, 1–3).

Weights follow the checkpoint (`checkpoint_slots`): with a `quantization` config, `wq_a`/`wkv`
(fused), `wq_b`, `wo_b` and `indexer.wq_b` are fp8 `Linear`s with their 32×32 block scales, `wo_a`
is dense (the checkpoint's fp8 dequantized at load), the rest bf16 and `attn_sink` fp32; without
one (random test models), everything is dense in the model dtype. `quant` picks the numerics:
"none" exact fp32/bf16 math (fp8 weights dequantized), "qat" the reference's
(docs/quantization.md): fp8 activations before the fp8 GEMMs, the SWA key fp8, the compressed key
fp4/e4m3, index queries and keys fp4, index scores in bf16. The caches receive the dequantized
(fake-quantized) values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv4cp.config import DeepseekV41Config
from dsv4cp.context import ForwardContext
from dsv4cp.cp.group import gather_global
from dsv4cp.executors import SERIAL, Executor
from dsv4cp.layers.linear import Linear, Storage
from dsv4cp.observe.timing import stage
from dsv4cp.ops.linear import WEIGHT_BLOCK
from dsv4cp.ops.quant import QuantMode, check_quant_mode
from dsv4cp.routing import (
    candidate_blocks,
    compressed_key,
    compressed_latent,
    grouped_wo_a,
    index_key,
    indexer_weights,
    linear_fp32,
    mqa_logits,
    pair_pool,
    rms_norm,
    rope_index_queries,
    rope_tail_,
    sparse_attention,
    sparse_attention_qat,
    store_swa_k,
    topk_among_blocks,
    topk_indices,
)
from dsv4cp.schedule import DEFAULT, Fork, Join, Node, PrepareState, Release, Schedule, Step

LOGITS_BUDGET_BYTES = 256 << 20  # fp32 MQA logits per row chunk


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class DeepseekV41Attention(nn.Module):
    """One V4.1 attention sub-layer (attention-math §4.2–§4.7, §5) on one CP rank."""

    def __init__(
        self,
        config: DeepseekV41Config,
        layer: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        quant: QuantMode = "none",
    ) -> None:
        super().__init__()
        c = config
        self.config, self.layer, self.dtype = c, layer, dtype
        self.quant = check_quant_mode(quant)
        self.role = c.layer_role(layer)
        self.n_heads, self.head_dim, self.rope_dim = (
            c.num_attention_heads,
            c.head_dim,
            c.qk_rope_head_dim,
        )
        self.index_heads, self.index_dim = c.index_n_heads, c.index_head_dim
        self.eps, self.window = c.rms_norm_eps, c.sliding_window
        self.theta, self.yarn = c.compress_rope(self.role.ratio)
        self.scale = c.head_dim**-0.5
        d, hd, rq = c.hidden_size, c.num_attention_heads * c.head_dim, c.q_lora_rank
        quantized = c.quantization is not None
        storage: Storage = "fp8" if quantized else "dense"
        if quantized and rq % WEIGHT_BLOCK:
            raise ValueError(
                f"layer {layer}: q_lora_rank {rq} must be a multiple of {WEIGHT_BLOCK} to hold "
                "wq_a and wkv fused in fp8 blocks"
            )
        self.storage = storage
        plain = torch.bfloat16 if quantized else dtype  # the checkpoint's bf16 tensors

        def w(*shape: int, dt: torch.dtype = plain) -> nn.Parameter:
            return _param(*shape, dtype=dt, device=device)

        def lin(n_in: int, n_out: int) -> Linear:
            return Linear(n_in, n_out, storage=storage, dtype=dtype, device=device)

        # wq_a and wkv are one fused GEMM (SGLang's wqkv_a); fp8 blocks of 32 rows concatenate
        # exactly because q_lora_rank is a multiple of 32. The checkpoint names views.
        self.wqkv_a = lin(d, rq + c.head_dim)
        self.q_norm = w(rq)
        self.wq_b = lin(rq, hd)
        self.kv_norm = w(c.head_dim)
        self.wo_a = w(c.o_groups * c.o_lora_rank, hd // c.o_groups, dt=dtype)  # dense at load
        self.wo_b = lin(c.o_groups * c.o_lora_rank, d)
        self.attn_sink = w(c.num_attention_heads, dt=torch.float32)
        if self.role.owns_compressor:
            # ratio 2: [wkv ; wgate] fused, one GEMM with an fp32 result.
            self.comp_wkv = w(c.head_dim * (2 if self.role.ratio == 2 else 1), d)
            self.comp_norm = w(c.head_dim)
            self.idx_wk = w(c.index_head_dim, c.head_dim)
            self.idx_k_norm = w(c.index_head_dim)
        if self.role.index_source:
            self.idx_wq_b = lin(rq, c.index_n_heads * c.index_head_dim)
            self.idx_weights_proj = w(c.index_n_heads, d)
        self.schedules: dict[bool, Schedule] = {}  # by overlap_gathers, built when first asked

    def checkpoint_slots(self, prefix: str) -> dict[str, Tensor]:
        """Checkpoint name → destination tensor (views of this layer's weights), names as in the
        released checkpoint under `prefix` (e.g. ``"layers.3.attn."``); fp8 weights come with
        their ``.scale``. Load with ``load_into(slots, reader, list(slots),
        dequantize=self.checkpoint_dequantize(prefix))``."""
        rq, d = self.config.q_lora_rank, self.head_dim
        out: dict[str, Tensor] = {}

        def linear(name: str, lin: Linear, rows: slice = slice(None)) -> None:
            out[f"{prefix}{name}.weight"] = lin.weight[rows]
            if lin.scale is not None:
                blocks = slice(
                    None if rows.start is None else rows.start // WEIGHT_BLOCK,
                    None if rows.stop is None else rows.stop // WEIGHT_BLOCK,
                )
                out[f"{prefix}{name}.scale"] = lin.scale[blocks]

        linear("wq_a", self.wqkv_a, slice(None, rq))
        linear("wkv", self.wqkv_a, slice(rq, None))
        out[f"{prefix}q_norm.weight"] = self.q_norm
        linear("wq_b", self.wq_b)
        out[f"{prefix}kv_norm.weight"] = self.kv_norm
        out[f"{prefix}wo_a.weight"] = self.wo_a
        linear("wo_b", self.wo_b)
        out[f"{prefix}attn_sink"] = self.attn_sink
        if self.role.owns_compressor:
            out[f"{prefix}compressor.wkv.weight"] = self.comp_wkv[:d]
            if self.role.ratio == 2:
                out[f"{prefix}compressor.wgate.weight"] = self.comp_wkv[d:]
            out[f"{prefix}compressor.norm.weight"] = self.comp_norm
            out[f"{prefix}indexer.wk.weight"] = self.idx_wk
            out[f"{prefix}indexer.k_norm.weight"] = self.idx_k_norm
        if self.role.index_source:
            linear("indexer.wq_b", self.idx_wq_b)
            out[f"{prefix}indexer.weights_proj.weight"] = self.idx_weights_proj
        return out

    def checkpoint_dequantize(self, prefix: str) -> frozenset[str]:
        """Checkpoint names `load_into` must dequantize: `wo_a` when the checkpoint stores it fp8
        (DeepSeek's converter does the same; the reference's grouped einsum takes bf16)."""
        return frozenset({f"{prefix}wo_a.weight"}) if self.storage == "fp8" else frozenset()

    def checkpoint_weights(self) -> dict[str, Tensor]:
        """`checkpoint_slots` with names relative to ``layers.{i}.attn.``."""
        return self.checkpoint_slots("")

    # ------------------------------------------------------------------ prepare nodes
    def _qkv_a(self, st: PrepareState) -> None:
        qkv = self.wqkv_a(st["x"], self.quant)
        rq = self.config.q_lora_rank
        st["q_raw"], st["kv_raw"] = qkv[:, :rq], qkv[:, rq:]

    def _compressor_proj(self, st: PrepareState) -> None:
        x = st["x"]
        if self.role.ratio == 2:
            # kv | gate in fp32: one gather carries both (4 KiB/token at D = 512).
            st["comp_kv"] = linear_fp32(x, self.comp_wkv)
        else:
            st["comp_kv"] = F.linear(x, self.comp_wkv.to(x.dtype))

    def _q_norm(self, st: PrepareState) -> None:
        st["q_lora"] = rms_norm(st["q_raw"], self.q_norm, self.eps)

    def _q_chain(self, st: PrepareState) -> None:
        local = st.ctx.local
        q = self.wq_b(st["q_lora"], self.quant).view(-1, self.n_heads, self.head_dim)
        st["q"] = rope_tail_(q, local.positions, self.rope_dim, self.theta, self.yarn)

    def _indexer_qw(self, st: PrepareState) -> None:
        local = st.ctx.local
        st["idx_q"] = rope_index_queries(
            self.idx_wq_b(st["q_lora"], self.quant),
            local.positions,
            self.rope_dim,
            self.theta,
            self.yarn,
            head_dim=self.index_dim,
            quant=self.quant,
        )
        st["idx_w"] = indexer_weights(st["x"], self.idx_weights_proj, head_dim=self.index_dim)

    def _gather_kv(self, st: PrepareState) -> None:
        ctx = st.ctx
        tag = f"layer{self.layer}/kv_raw"
        st["kv_raw_g"] = gather_global(ctx.cp, ctx.layout, st["kv_raw"], tag=tag)

    def _gather_comp(self, st: PrepareState) -> None:
        ctx = st.ctx
        tag = f"layer{self.layer}/comp_kv"
        st["comp_kv_g"] = gather_global(ctx.cp, ctx.layout, st["comp_kv"], tag=tag)

    def _swa_store(self, st: PrepareState) -> None:
        ctx = st.ctx
        tok = ctx.meta.tokens
        cache = ctx.cache.swa_cache(self.layer)
        store_swa_k(
            st["kv_raw_g"],
            tok.positions,
            tok.slots,
            cache,
            self.kv_norm,
            self.eps,
            self.rope_dim,
            self.theta,
            self.yarn,
            self.quant,
        )
        st["swa_cache"] = cache

    def _compressor(self, st: PrepareState) -> None:
        """Every rank runs the same compressor over the same global rows (state never travels)."""
        ctx = st.ctx
        tok = ctx.meta.tokens
        cache = ctx.cache
        r, d = self.role.ratio, self.head_dim
        g = st["comp_kv_g"]
        if r == 2:
            kv, gate = g[:, :d], g[:, d:]
            from_state = tok.pair_partner_from_state()[:, None]
            read = tok.pair_state_read_slots()
            prev_kv = torch.cat([kv[:1], kv[:-1]])
            prev_gate = torch.cat([gate[:1], gate[:-1]])
            partner_kv = torch.where(from_state, cache.pair_kv[self.layer][read], prev_kv)
            partner_gate = torch.where(from_state, cache.pair_gate[self.layer][read], prev_gate)
            pooled = pair_pool(kv, gate, partner_kv, partner_gate)
            write = tok.pair_state_write_slots()
            cache.pair_kv[self.layer][write] = kv
            cache.pair_gate[self.layer][write] = gate
        else:
            pooled = g
        latent = compressed_latent(pooled, self.comp_norm, self.eps, self.dtype)
        entry_pos = tok.entry_positions(r)
        emit = tok.emit_slots(r)
        ckey = compressed_key(
            latent, entry_pos, self.rope_dim, self.theta, self.yarn, quant=self.quant
        )
        cache.comp_cache(self.layer)[emit] = ckey.to(cache.dtype)
        ikey = index_key(
            latent,
            self.idx_wk,
            self.idx_k_norm,
            self.eps,
            entry_pos,
            self.rope_dim,
            self.theta,
            self.yarn,
            quant=self.quant,
        )
        index_cache = cache.index_k[self.layer]
        index_cache[emit] = ikey.to(index_cache.dtype)
        ws = index_cache[ctx.meta.workspaces[r].slots]
        ctx.cross.index_k_ws[r] = ws
        st["comp_cache"] = cache.comp_cache(self.layer)
        st["index_k_ws"] = ws

    def _logits_topk(self, st: PrepareState) -> None:
        """Local index queries × the ratio's index-K workspace → top-k (and candidates)."""
        ctx = st.ctx
        r = self.role.ratio
        local = ctx.local
        ws_meta = ctx.meta.workspaces[r]
        keys = ctx.cross.index_k_ws[r]
        n_vis = local.n_visible(r)
        k_start = ctx.workspace_start(r)
        width = max(ws_meta.max_entries, 1)
        rows = local.num_rows
        chunk = max(1, min(rows, LOGITS_BUDGET_BYTES // (4 * width)))
        cfg = self.config
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
                quant=self.quant,
            )
            if self.role.candidate_consumer:
                blocks = ctx.cross.candidates[r][a:b]
                topk_parts.append(
                    topk_among_blocks(
                        logits, n_vis[a:b], blocks, cfg.candidate_block_size, cfg.index_topk
                    )
                )
            else:
                topk_parts.append(topk_indices(logits, n_vis[a:b], cfg.index_topk))
            if self.role.candidate_source:
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

    # ------------------------------------------------------------------ schedule
    def schedule(self, overlap_gathers: bool = True) -> Schedule:
        """The one description of this layer's prepare, built on first use per variant.

        `overlap_gathers=False` forks the compute-only lanes after the gathers instead of before
        them: the graph runner asks for it when gathers are eager graph breaks, since a break
        may not sit inside an open fork.
        """
        sched = self.schedules.get(overlap_gathers)
        if sched is None:
            sched = self.schedules[overlap_gathers] = self._build_schedule(overlap_gathers)
        return sched

    def _build_schedule(self, overlap_gathers: bool) -> Schedule:
        role = self.role

        def node(
            fn: Callable[[PrepareState], None],
            reads: tuple[str, ...],
            writes: tuple[str, ...],
            lane: str = DEFAULT,
            collective: bool = False,
        ) -> Node:  # a node is named after its method: `_q_chain` → "q_chain"
            return Node(fn.__name__.removeprefix("_"), fn, reads, writes, lane, collective)

        kv_src, idx = role.owns_compressor, role.index_source
        steps: list[Step] = [node(self._qkv_a, ("x",), ("q_raw", "kv_raw"))]
        if kv_src:
            steps.append(node(self._compressor_proj, ("x",), ("comp_kv",)))
        steps.append(node(self._q_norm, ("q_raw",), ("q_lora",)))
        q_lanes: list[Step] = [Fork(("q", "indexer") if idx else ("q",), compute_only=True)]
        q_lanes.append(node(self._q_chain, ("q_lora",), ("q",), lane="q"))
        if idx:
            q_lanes.append(
                node(self._indexer_qw, ("q_lora", "x"), ("idx_q", "idx_w"), lane="indexer")
            )
        gathers: list[Step] = [node(self._gather_kv, ("kv_raw",), ("kv_raw_g",), collective=True)]
        if kv_src:
            gathers.append(node(self._gather_comp, ("comp_kv",), ("comp_kv_g",), collective=True))
        steps += q_lanes + gathers if overlap_gathers else gathers + q_lanes
        side = ("swa", "compressor") if kv_src else ("swa",)
        steps.append(Fork(side))
        steps.append(node(self._swa_store, ("kv_raw_g",), ("swa_cache",), lane="swa"))
        if kv_src:
            steps.append(
                node(
                    self._compressor,
                    ("comp_kv_g",),
                    ("comp_cache", "index_k_ws"),
                    lane="compressor",
                )
            )
        steps.append(Join(("q", "indexer", *side) if idx else ("q", *side)))
        if idx:
            steps.append(node(self._logits_topk, ("idx_q", "idx_w"), ("topk",)))
        released = ["q_raw", "kv_raw", "kv_raw_g", "q_lora"]
        if kv_src:
            released += ["comp_kv", "comp_kv_g"]
        if idx:
            released += ["idx_q", "idx_w"]
        steps.append(Release(tuple(released)))
        outputs = ("q", "swa_cache") + (("topk",) if idx else ())
        name = f"layer{role.layer}:{role.name}" + ("" if overlap_gathers else ":gathers-first")
        return Schedule(name, tuple(steps), ("x",), outputs)

    # ------------------------------------------------------------------ forward
    def prepare(self, x: Tensor, ctx: ForwardContext, executor: Executor = SERIAL) -> PrepareState:
        return executor.run(self.schedule(executor.overlap_gathers), PrepareState(ctx, x=x))

    def forward(self, x: Tensor, ctx: ForwardContext, executor: Executor = SERIAL) -> Tensor:
        st = self.prepare(x, ctx, executor)
        with stage("sparse_attention"):
            o = self.attend(st["q"], ctx)
        with stage("output_proj"):
            return self.wo_b(grouped_wo_a(o, self.wo_a, self.config.o_groups), self.quant)

    def sparse_indices(self, ctx: ForwardContext) -> Tensor:
        """[L, W (+ K_top)] int32 rows of the KV pool: the SWA window, then top-k entries.

        Each part lists its keys in ascending position, -1 pads last, as the reference's
        `get_window_topk_idxs` and sorted top-k do: the fp32 sums of the attention then add the
        same terms in the same order."""
        local, cache = ctx.local, ctx.cache
        win = local.window_slots(self.window)  # positions p, p-1, …, -1 pads last
        n_win = (win >= 0).sum(dim=1, keepdim=True)
        j = torch.arange(win.shape[1], device=win.device)
        win = torch.where(j < n_win, win.gather(1, (n_win - 1 - j).clamp(min=0)), -1)
        parts = [torch.where(win >= 0, win + cache.swa_base(self.layer), -1)]
        src = self.role.kv_source
        if self.role.compressed:
            if src is None:
                raise ValueError(f"layer {self.layer}: a compressed layer needs a kv source")
            topk = ctx.cross.topk[self.role.ratio]
            comp = local.entry_slots(self.role.ratio, topk)
            parts.append(torch.where(comp >= 0, comp + cache.comp_base(src), -1))
        return torch.cat(parts, dim=1).to(torch.int32)

    def attend(self, q: Tensor, ctx: ForwardContext) -> Tensor:
        local = ctx.local
        idx = self.sparse_indices(ctx)
        # qat: the reference's probability rounding; no kernel has it yet (docs/performance.md)
        attention = sparse_attention_qat if self.quant == "qat" else sparse_attention
        o = attention(q, ctx.cache.kv_pool, idx, self.attn_sink, self.scale)
        o = rope_tail_(o, local.positions, self.rope_dim, self.theta, self.yarn, inverse=True)
        # Padding rows are zeroed before any reduction (docs/invariants.md, invariant 5).
        return o * local.valid[:, None, None].to(o.dtype)
