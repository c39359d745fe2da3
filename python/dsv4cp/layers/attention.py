"""`DeepseekV41Attention`: one V4.1 attention sub-layer on one CP rank.

Read top to bottom: the weights (DeepSeek's checkpoint names as views); the prepare, one method
per schedule node, each reading and writing named buffers of a `PrepareState`; `schedule()`, the
DAG those nodes form for this layer's role (built by `attention_schedule.build_schedule`); and
`forward` = prepare → sparse attention → inverse RoPE → `wo_a` → `wo_b` (attention-math
§4.2–§4.7, §5); `sparse_rows` names the cache rows the sparse attention reads and bounds its
workspace. The reference is DeepSeek's
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
fp4/e4m3, index queries and keys fp4, index scores in bf16. The KV cache must hold keys of the
same mode: it stores them as the numerics define (`KVCache.encode`: fp8 / fp4 codes + scales in
qat), and the attention and the index logits dequantize what they read (docs/caches.md).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dsv4cp.config import DeepseekV41Config
from dsv4cp.context import ForwardContext
from dsv4cp.cp.group import gather_indexed, gather_rows, stays_rank_major
from dsv4cp.executors import SERIAL, Executor
from dsv4cp.layers import sparse_rows
from dsv4cp.layers.attention_schedule import build_schedule
from dsv4cp.layers.linear import Linear, Storage
from dsv4cp.layers.sparse_rows import kv_source
from dsv4cp.observe.timing import stage
from dsv4cp.ops.kv_format import store_rows_
from dsv4cp.ops.linear import WEIGHT_BLOCK
from dsv4cp.ops.matmul import linear_rows
from dsv4cp.ops.quant import QuantMode, check_quant_mode
from dsv4cp.routing import (
    compress_entries,
    grouped_wo_a,
    indexer_weights,
    linear_fp32,
    mqa_logits_cached,
    mqa_topk_cached,
    rms_norm,
    rope_index_queries,
    rope_tail_,
    sparse_attention_cached,
    store_index_keys,
    swa_key_rows,
    swa_rows,
)
from dsv4cp.schedule import PrepareState, Schedule


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
        out.update(self.wqkv_a.checkpoint_slots(f"{prefix}wq_a.", slice(None, rq)))
        out.update(self.wqkv_a.checkpoint_slots(f"{prefix}wkv.", slice(rq, None)))
        out[f"{prefix}q_norm.weight"] = self.q_norm
        out.update(self.wq_b.checkpoint_slots(f"{prefix}wq_b."))
        out[f"{prefix}kv_norm.weight"] = self.kv_norm
        out[f"{prefix}wo_a.weight"] = self.wo_a
        out.update(self.wo_b.checkpoint_slots(f"{prefix}wo_b."))
        out[f"{prefix}attn_sink"] = self.attn_sink
        if self.role.owns_compressor:
            out[f"{prefix}compressor.wkv.weight"] = self.comp_wkv[:d]
            if self.role.ratio == 2:
                out[f"{prefix}compressor.wgate.weight"] = self.comp_wkv[d:]
            out[f"{prefix}compressor.norm.weight"] = self.comp_norm
            out[f"{prefix}indexer.wk.weight"] = self.idx_wk
            out[f"{prefix}indexer.k_norm.weight"] = self.idx_k_norm
        if self.role.index_source:
            out.update(self.idx_wq_b.checkpoint_slots(f"{prefix}indexer.wq_b."))
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
            st["comp_kv"] = linear_rows(x, self.comp_wkv.to(x.dtype))

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

    def _swa_rows(self, st: PrepareState) -> None:
        """This rank's SWA keys as the cache stores them (row-local: norm, RoPE, quantizer), so
        the gather carries stored rows (528 B/token in qat) instead of the raw latent."""
        cache = st.ctx.cache
        st["swa_rows"] = swa_key_rows(
            st["kv_raw"],
            st.ctx.local.positions,
            self.kv_norm,
            self.eps,
            self.rope_dim,
            self.theta,
            self.yarn,
            self.quant,
            cache.numerics.swa,
            cache.stored_dtype("swa"),
        )

    def _gather_kv(self, st: PrepareState) -> None:
        ctx = st.ctx
        tag = f"layer{self.layer}/swa_rows"
        st["swa_rows_g"] = gather_rows(ctx.cp, ctx.layout, st["swa_rows"], tag=tag)

    def _gather_comp(self, st: PrepareState) -> None:
        ctx = st.ctx
        tag = f"layer{self.layer}/comp_kv"
        # rank-major rows and the token → row index: the compressor reads them in token order
        st["comp_kv_g"] = gather_indexed(ctx.cp, ctx.layout, st["comp_kv"], tag=tag)

    def _swa_store(self, st: PrepareState) -> None:
        ctx = st.ctx
        kv, memo = ctx.cache, ctx.cross.attention
        cache = kv.swa[self.layer]
        if memo.store_rows is None:  # the same rows in every layer of the forward, gather order
            rows = swa_rows(ctx.meta.tokens.slots, *kv.swa_pool_map)
            if stays_rank_major(ctx.cp, ctx.layout):
                rows = ctx.layout.rank_major(rows)
            memo.store_rows = rows
        store_rows_(cache, memo.store_rows, st["swa_rows_g"])
        st["swa_cache"] = cache

    def _compressor(self, st: PrepareState) -> None:
        """Every rank runs the same compressor over the same global rows (state never travels),
        read in token order from the all-gather's rank-major rows through their index."""
        ctx = st.ctx
        comp_kv, src_rows = st["comp_kv_g"]
        tok = ctx.meta.tokens
        cache = ctx.cache
        r = self.role.ratio
        pair = (cache.pair_kv[self.layer], cache.pair_gate[self.layer]) if r == 2 else None
        read = cache.pair_read_rows(tok) if r == 2 else None
        write = cache.pair_write_rows(tok) if r == 2 else None
        entry_pos = tok.entry_positions(r)
        emit = cache.entry_rows(r, tok.emit_slots(r))
        latent = compress_entries(
            comp_kv,
            pair,
            read,
            write,
            self.comp_norm,
            self.eps,
            self.dtype,
            entry_pos,
            emit,
            cache.compressed[self.layer],
            cache.numerics.compressed,
            self.rope_dim,
            self.theta,
            self.yarn,
            src_rows,
        )
        store_index_keys(
            latent,
            self.idx_wk,
            self.idx_k_norm,
            self.eps,
            entry_pos,
            emit,
            cache.index[self.layer],
            cache.numerics.index,
            self.rope_dim,
            self.theta,
            self.yarn,
        )
        st["comp_cache"] = cache.compressed[self.layer]
        st["index_cache"] = cache.index[self.layer]

    def index_queries(self, x: Tensor, ctx: ForwardContext) -> tuple[Tensor, Tensor]:
        """An index source's index queries and head weights of this rank's rows from its
        attention input x, by the prepare's own nodes run serially (not the forward path)."""
        st = PrepareState(ctx, x=x)
        for node in (self._qkv_a, self._q_norm, self._indexer_qw):
            node(st)
        return st["idx_q"], st["idx_w"]

    def index_logits(
        self, q: Tensor, w: Tensor, ctx: ForwardContext, rows: slice = slice(None)
    ) -> Tensor:
        """Index scores fp32 [n, width] of this rank's local rows `rows` (q, w: their index
        queries and head weights) against every entry of the layer's ratio, read from the kv
        source's index cache (the workspace entries' rows, decoded on load)."""
        r = self.role.ratio
        ws = ctx.meta.workspaces[r]
        cache = ctx.cache
        return mqa_logits_cached(
            q,
            w,
            cache.index[kv_source(self.role)],
            cache.entry_rows(r, ws.slots),
            ctx.local.n_visible(r)[rows],
            k_start=ctx.workspace_start(r)[rows],
            width=max(ws.max_entries, 1),
            k_format=cache.formats.index,
            quant=self.quant,
        )

    def _logits_topk(self, st: PrepareState) -> None:
        """Local index queries × the ratio's index keys, read from the kv source's index cache,
        → top-k (and candidates) in one routed op (`mqa_topk_cached`): on CUDA the fused
        logits + running top-k kernel (the [rows, context] logits never reach memory; a plain
        top-k over ≤ 8K keys: logits in row chunks, then the top-k kernel), on CPU the ops twin
        (`index_logits` in row chunks, then the selection)."""
        ctx = st.ctx
        r, cfg, cache = self.role.ratio, self.config, ctx.cache
        ws = ctx.meta.workspaces[r]
        topk, blocks = mqa_topk_cached(
            st["idx_q"],
            st["idx_w"],
            cache.index[kv_source(self.role)],
            cache.entry_rows(r, ws.slots),
            ctx.local.n_visible(r),
            cfg.index_topk,
            k_start=ctx.workspace_start(r),
            width=max(ws.max_entries, 1),
            k_format=cache.formats.index,
            quant=self.quant,
            block_size=cfg.candidate_block_size,
            max_blocks=cfg.candidate_topk_blocks if self.role.candidate_source else 0,
            block_ids=ctx.cross.candidates[r] if self.role.candidate_consumer else None,
            mean_visible=ws.mean_visible,
        )
        ctx.cross.topk[r] = topk
        if blocks is not None:
            ctx.cross.candidates[r] = blocks
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
            sched = self.schedules[overlap_gathers] = build_schedule(self, overlap_gathers)
        return sched

    # ------------------------------------------------------------------ forward
    def prepare(self, x: Tensor, ctx: ForwardContext, executor: Executor = SERIAL) -> PrepareState:
        if ctx.cache.quant != self.quant:
            raise ValueError(
                f"layer {self.layer}: quant {self.quant!r} but the KV cache stores "
                f"{ctx.cache.quant!r} keys (build the KVCache with the model's quant)"
            )
        return executor.run(self.schedule(executor.overlap_gathers), PrepareState(ctx, x=x))

    def forward(self, x: Tensor, ctx: ForwardContext, executor: Executor = SERIAL) -> Tensor:
        st = self.prepare(x, ctx, executor)
        with stage("sparse_attention"):
            o = self.attend(st["q"], ctx)
        with stage("output_proj"):
            z = grouped_wo_a(o, self.wo_a, self.config.o_groups)
            # Padding rows are zeroed before any reduction across rows (docs/invariants.md,
            # invariant 5). wo_a is row-local, so zeroing its output (4x narrower than o at Flash
            # dims) equals zeroing o; it also clears a non-finite padding row. On the fp8 path
            # the zeroing is inside wo_b's activation quantization (no pass of its own).
            return self.wo_b(z, self.quant, rows_valid=ctx.local.valid)

    def sparse_indices(self, ctx: ForwardContext) -> tuple[Tensor, Tensor | None]:
        """This layer's window rows and top-k rows (`sparse_rows.sparse_indices`)."""
        return sparse_rows.sparse_indices(self.role, self.window, ctx)

    def workspace_rows(self, ctx: ForwardContext) -> tuple[int, int]:
        """Bounds on the distinct rows they name (`sparse_rows.workspace_rows`)."""
        return sparse_rows.workspace_rows(self.role, self.window, ctx)

    def attend(self, q: Tensor, ctx: ForwardContext) -> Tensor:
        local, cache = ctx.local, ctx.cache
        win, comp_idx = self.sparse_indices(ctx)
        comp = cache.compressed[kv_source(self.role)] if comp_idx is not None else None
        o = sparse_attention_cached(
            q,
            cache.swa[self.layer],
            win,
            comp,
            comp_idx,
            self.attn_sink,
            self.scale,
            cache.formats.swa,
            cache.formats.compressed,
            self.quant,
            workspace_rows=self.workspace_rows(ctx),
            workspace_memo=sparse_rows.workspace_memo(self.role, ctx),
            comp_rows=sparse_rows.comp_rows(self.role, ctx),
        )
        # Padding rows' outputs are zeroed by `forward` after wo_a (invariant 5).
        return rope_tail_(o, local.positions, self.rope_dim, self.theta, self.yarn, inverse=True)
