"""`DeepseekV41Attention`: weights and forward = prepare (schedule) → sparse attention → output."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dsv4cp.config import DeepseekV41Config
from dsv4cp.context import ForwardContext
from dsv4cp.executors import SERIAL, Executor
from dsv4cp.observe.timing import stage
from dsv4cp.prepare import build_schedule
from dsv4cp.routing import grouped_output, rope_tail_, sparse_attention
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
    ) -> None:
        super().__init__()
        c = config
        self.config, self.layer, self.dtype = c, layer, dtype
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
        d, hd = c.hidden_size, c.num_attention_heads * c.head_dim
        p = dict(dtype=dtype, device=device)
        # wq_a and wkv are stored fused (one GEMM, SGLang's wqkv_a); the checkpoint names views.
        self.wqkv_a = _param(c.q_lora_rank + c.head_dim, d, **p)
        self.q_norm = _param(c.q_lora_rank, **p)
        self.wq_b = _param(hd, c.q_lora_rank, **p)
        self.kv_norm = _param(c.head_dim, **p)
        self.wo_a = _param(c.o_groups * c.o_lora_rank, hd // c.o_groups, **p)
        self.wo_b = _param(d, c.o_groups * c.o_lora_rank, **p)
        self.attn_sink = _param(c.num_attention_heads, dtype=torch.float32, device=device)
        if self.role.owns_compressor:
            # ratio 2: [wkv ; wgate] fused, one GEMM with an fp32 result.
            self.comp_wkv = _param(c.head_dim * (2 if self.role.ratio == 2 else 1), d, **p)
            self.comp_norm = _param(c.head_dim, **p)
            self.idx_wk = _param(c.index_head_dim, c.head_dim, **p)
            self.idx_k_norm = _param(c.index_head_dim, **p)
        if self.role.index_source:
            self.idx_wq_b = _param(c.index_n_heads * c.index_head_dim, c.q_lora_rank, **p)
            self.idx_weights_proj = _param(c.index_n_heads, d, **p)
        self.schedules: dict[bool, Schedule] = {}  # by overlap_gathers, built when first asked

    def checkpoint_weights(self) -> dict[str, Tensor]:
        """DeepSeek checkpoint names (under `layers.{i}.attn.`) → views of this layer's weights."""
        rq, d = self.config.q_lora_rank, self.head_dim
        out = {
            "wq_a.weight": self.wqkv_a[:rq],
            "wkv.weight": self.wqkv_a[rq:],
            "q_norm.weight": self.q_norm,
            "wq_b.weight": self.wq_b,
            "kv_norm.weight": self.kv_norm,
            "wo_a.weight": self.wo_a,
            "wo_b.weight": self.wo_b,
            "attn_sink": self.attn_sink,
        }
        if self.role.owns_compressor:
            out["compressor.wkv.weight"] = self.comp_wkv[:d]
            if self.role.ratio == 2:
                out["compressor.wgate.weight"] = self.comp_wkv[d:]
            out["compressor.norm.weight"] = self.comp_norm
            out["indexer.wk.weight"] = self.idx_wk
            out["indexer.k_norm.weight"] = self.idx_k_norm
        if self.role.index_source:
            out["indexer.wq_b.weight"] = self.idx_wq_b
            out["indexer.weights_proj.weight"] = self.idx_weights_proj
        return out

    def schedule(self, overlap_gathers: bool = True) -> Schedule:
        """This layer's prepare; `overlap_gathers=False` is the gathers-first variant."""
        sched = self.schedules.get(overlap_gathers)
        if sched is None:
            sched = build_schedule(self, overlap_gathers=overlap_gathers)
            self.schedules[overlap_gathers] = sched
        return sched

    # ------------------------------------------------------------------ forward
    def prepare(self, x: Tensor, ctx: ForwardContext, executor: Executor = SERIAL) -> PrepareState:
        return executor.run(self.schedule(executor.overlap_gathers), PrepareState(ctx, x=x))

    def forward(self, x: Tensor, ctx: ForwardContext, executor: Executor = SERIAL) -> Tensor:
        st = self.prepare(x, ctx, executor)
        with stage("sparse_attention"):
            o = self.attend(st["q"], ctx)
        with stage("output_proj"):
            return grouped_output(o, self.wo_a, self.wo_b, self.config.o_groups)

    def sparse_indices(self, ctx: ForwardContext) -> Tensor:
        """[L, W (+ K_top)] int32 rows of the KV pool: the SWA window, then top-k entries."""
        local, cache = ctx.local, ctx.cache
        win = local.window_slots(self.window)
        parts = [torch.where(win >= 0, win + cache.swa_base(self.layer), -1)]
        if self.role.compressed:
            topk = ctx.cross.topk[self.role.ratio]
            comp = local.entry_slots(self.role.ratio, topk)
            parts.append(torch.where(comp >= 0, comp + cache.comp_base(self.role.kv_source), -1))
        return torch.cat(parts, dim=1).to(torch.int32)

    def attend(self, q: Tensor, ctx: ForwardContext) -> Tensor:
        local = ctx.local
        idx = self.sparse_indices(ctx)
        o = sparse_attention(q, ctx.cache.kv_pool, idx, self.attn_sink, self.scale)
        o = rope_tail_(o, local.positions, self.rope_dim, self.theta, self.yarn, inverse=True)
        # Padding rows are zeroed before any reduction (docs/invariants.md, invariant 5).
        return o * local.valid[:, None, None].to(o.dtype)
