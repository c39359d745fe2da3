"""`DeepseekV41Model`: the DeepSeek-V4.1 text model and its one forward, shared by `PrefillRunner`
(eager and graph capture) and the SGLang adapter.

embedding → `hc_mult` copies (hyper-connections; a plain residual row when `hc_mult` = 1) →
blocks (`layers/block.py`: Engram, attention, FFN = MoE or dense SwiGLU) → final collapse with the
last block's FFN `pre` → gather of the global rows → final norm → fp32 head (DeepSeek reference
`model.py: Transformer.forward`, `ParallelHead`). The quant mode ("none" / "qat") is fixed at
construction; a part that does not implement the asked mode raises there, never runs another.

Weights: `checkpoint_weights()` maps the release's tensor names (dsv4cp's own `ffn.w{1,2,3}` for
the dense test FFN) to the model's tensors. A released-format checkpoint loads with
`from_checkpoint` (`loader.py`); dsv4cp's own single-file exports with `save_pretrained` /
`from_pretrained`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import cast, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv4cp.checkpoint.errors import CheckpointError
from dsv4cp.config import (
    EXPORT_MODEL_TYPE,
    DeepseekV41Config,
    checkpoint_kind,
    not_a_checkpoint_dir,
)
from dsv4cp.context import ForwardContext
from dsv4cp.cp.group import CPGroup, gather_global
from dsv4cp.executors import SERIAL_ONLY, LayerExecutors
from dsv4cp.layers.block import DeepseekV41Block
from dsv4cp.layers.engram import Engram
from dsv4cp.layers.engram_hashes import EngramHashes
from dsv4cp.layers.hyper_connections import hc_collapse
from dsv4cp.layers.linear import KeptWeights, keep_dequantized_weights
from dsv4cp.layers.moe import MoE
from dsv4cp.observe.timing import stage
from dsv4cp.ops import check_quant_mode, rms_norm
from dsv4cp.ops.engram import RowSource
from dsv4cp.ops.engram_hash import NgramHasher
from dsv4cp.ops.finite import check_finite, finite_check_requested
from dsv4cp.ops.hyper_connections import hc_expand_embedding, identity_pre
from dsv4cp.ops.matmul import linear_rows
from dsv4cp.ops.moe_experts import GroupedBackend
from dsv4cp.ops.quant import QuantMode
from dsv4cp.random_weights import init_random_
from dsv4cp.schedule import lanes_of

__all__ = ["WEIGHTS_FILE", "BlockInputHook", "DeepseekV41Model", "LayerHook", "init_random_"]

WEIGHTS_FILE = "model.safetensors"
# (name, this rank's output rows of the layer, the forward's context): see `layer_hook`.
LayerHook = Callable[[str, Tensor, ForwardContext], None]
# (block, streams entering it, pre handed to it, context) -> the (streams, pre) to use instead.
BlockInputHook = Callable[
    [int, Tensor, Tensor | None, ForwardContext], tuple[Tensor, Tensor | None]
]


def _capturing(t: Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def check_supported(config: DeepseekV41Config, quant: QuantMode) -> None:
    """Refuse a mode some part of this model does not implement (NotImplementedError): `qat`
    needs the released storage (a `quantization` config: fp8 attention projections, fp4 experts)
    and the MoE; the dense test FFN and dense attention weights have no quantized GEMM."""
    if quant != "qat":
        return
    if config.quantization is None:
        raise NotImplementedError(
            "quant='qat': the config has no quantization_config, so the attention projections "
            "are dense and would skip the reference's fp8 GEMM steps; use quant='none'"
        )
    if not config.n_routed_experts:
        raise NotImplementedError(
            "quant='qat': the dense SwiGLU FFN (configs without MoE) has no quantized storage; "
            "only the released MoE is quantized"
        )


def default_quant(config: DeepseekV41Config) -> QuantMode:
    """The quant mode a config runs with unless asked otherwise: "qat" when it has a
    quantization_config (the released storage), else "none" (the SGLang server's default)."""
    return "qat" if config.quantization is not None else "none"


class DeepseekV41Model(nn.Module):
    """`layer_hook`, when set (by `tools.checking`), sees every block's output rows (streams
    [P, H, d] with hyper-connections); `block_input_hook` may replace what enters a block
    (teacher forcing, `tools.reference_check`). With either set the runner runs eagerly, since
    a graph replay keeps no intermediate rows."""

    def __init__(
        self,
        config: DeepseekV41Config,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        seed: int | None = 0,
        quant: str = "none",
        ep: CPGroup | None = None,
    ) -> None:
        """`ep`: the expert-parallel group (docs/ep.md): every MoE holds this rank's
        n_routed_experts / ep.cp_size experts and exchanges pairs over it; None = every expert
        here. Fixed for the model's life (its weights are sharded)."""
        super().__init__()
        self.quant = check_quant_mode(quant)
        self.ep = ep
        check_supported(config, self.quant)
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        d, v = config.hidden_size, config.vocab_size
        self.embed = nn.Parameter(
            torch.empty(v, d, dtype=dtype, device=device), requires_grad=False
        )
        self.layers = nn.ModuleList(
            DeepseekV41Block(config, i, dtype=dtype, device=device, quant=self.quant, ep=ep)
            for i in range(config.num_hidden_layers)
        )
        self.norm = nn.Parameter(torch.empty(d, dtype=dtype, device=device), requires_grad=False)
        # fp32 like the reference's ParallelHead (bf16 in the checkpoint): fp32 logits directly.
        self.head = nn.Parameter(
            torch.empty(v, d, dtype=torch.float32, device=device), requires_grad=False
        )
        self.engram_hashes: EngramHashes | None = None
        self.layer_hook: LayerHook | None = None
        # DSV4CP_CHECK_FINITE=1: every layer's output is checked on the host (debugging).
        self.check_finite = finite_check_requested()
        self.block_input_hook: BlockInputHook | None = None
        if seed is not None:
            self.init_random(seed)

    @property
    def blocks(self) -> list[DeepseekV41Block]:
        """The blocks, typed (iterating an nn.ModuleList yields plain Modules)."""
        return [cast(DeepseekV41Block, block) for block in self.layers]

    @property
    def hooked(self) -> bool:
        """A hook wants intermediate rows: forwards must run eagerly."""
        return self.layer_hook is not None or self.block_input_hook is not None

    @property
    def engram_layers(self) -> list[Engram]:
        return [b.engram for b in self.blocks if b.engram is not None]

    def set_quant(self, quant: str) -> None:
        """Switch the numerics of every part (the storage stays as built): for comparisons of
        the two modes on the same weights. Checked like the constructor's `quant`."""
        mode = check_quant_mode(quant)
        check_supported(self.config, mode)
        self.quant = mode
        for block in self.blocks:
            block.quant = block.attn.quant = mode

    def set_moe_backend(self, backend: GroupedBackend) -> None:
        """The routed experts' backend of every block ("auto": grouped_mm for CUDA bf16)."""
        for block in self.blocks:
            block.moe_backend = backend

    # ------------------------------------------------------------------ weights
    def keep_dequantized_weights(self, scope: KeptWeights = "attention") -> int:
        """Hold bf16 copies of fp8 weights for the cuBLAS GEMM route (`Linear.keep_dequantized`):
        "attention" — the attention layers' projections; "all" — every fp8 linear (also the
        shared experts and Engram's); "off" — none (drops any held). Returns the bytes held."""
        if scope not in get_args(KeptWeights):
            raise ValueError(
                f"keep_dequantized_weights: scope {scope!r} not in {get_args(KeptWeights)}"
            )
        keep_dequantized_weights(self, False)
        if scope == "off":
            return 0
        parts = [b.attn for b in self.blocks] if scope == "attention" else [self]
        return sum(keep_dequantized_weights(m) for m in parts)

    def checkpoint_weights(self) -> dict[str, Tensor]:
        """Checkpoint name → the model's tensor (views), Engram tables excepted."""
        out: dict[str, Tensor] = {
            "embed.weight": self.embed,
            "norm.weight": self.norm,
            "head.weight": self.head,
        }
        for block in self.blocks:
            out.update(block.checkpoint_slots(f"layers.{block.layer}."))
        return out

    def init_random(self, seed: int, *, device: torch.device | str = "cpu") -> None:
        """Deterministic random weights (`init_random_`); Engram tables are not drawn. With EP
        the other ranks' experts are drawn too, into scratch, so every value is EP = 1's."""
        weights = self.checkpoint_weights()
        for block in self.blocks:
            if isinstance(block.ffn, MoE) and block.ffn.ep is not None:
                weights.update(block.ffn.foreign_expert_slots(f"layers.{block.layer}.ffn."))
        init_random_(weights, self.config, seed, device=device)

    def attach_engram(
        self, hasher: NgramHasher, tables: dict[int, tuple[RowSource, RowSource]]
    ) -> None:
        """The n-gram hasher (from the tokenizer) and each Engram layer's table (codes, scales:
        host tensors or shard memmaps, never copied whole)."""
        layers = {e.layer_id: e for e in self.engram_layers}
        if set(tables) != set(layers):
            raise ValueError(
                f"attach_engram: tables for layers {sorted(tables)}, the model's Engram layers "
                f"are {sorted(layers)}"
            )
        if tuple(hasher.layer_ids) != tuple(self.config.engram_layer_ids):
            raise ValueError(
                f"attach_engram: the hasher is for layers {hasher.layer_ids}, the config's "
                f"engram_layer_ids are {self.config.engram_layer_ids}"
            )
        for layer, (weight, scale) in tables.items():
            layers[layer].attach_table(weight, scale)
        self.engram_hashes = EngramHashes(hasher, self.config.vocab_size, self.device)

    def save_pretrained(self, path: str | os.PathLike[str]) -> None:
        """dsv4cp's own export: config.json and one model.safetensors in the model's storage."""
        from safetensors.torch import save_file

        if self.engram_layers:
            raise ValueError("save_pretrained: Engram tables are not exported (no writer)")
        if self.ep is not None and self.ep.cp_size > 1:
            raise ValueError("save_pretrained: an expert-parallel model holds only its experts")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**self.config.to_hf(), "model_type": EXPORT_MODEL_TYPE}, f, indent=2)
        tensors = {k: v.detach().cpu().clone() for k, v in self.checkpoint_weights().items()}
        save_file(tensors, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})

    @torch.no_grad()
    def load_state(self, tensors: dict[str, Tensor], *, strict: bool = True) -> None:
        mine = self.checkpoint_weights()
        missing = sorted(set(mine) - set(tensors))
        unexpected = sorted(set(tensors) - set(mine))
        if strict and (missing or unexpected):
            raise ValueError(
                f"checkpoint mismatch: missing {missing[:8]}{'…' if len(missing) > 8 else ''}, "
                f"unexpected {unexpected[:8]}{'…' if len(unexpected) > 8 else ''}"
            )
        staged = {}
        for name, t in tensors.items():
            if name not in mine:
                continue
            dst = mine[name]
            if tuple(dst.shape) != tuple(t.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != {tuple(dst.shape)}")
            staged[name] = t.to(dtype=dst.dtype, device=dst.device)
            check_finite(staged[name], f"checkpoint tensor {name!r}")
        for name, value in staged.items():  # written only once every tensor passed
            mine[name].copy_(value)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        quant: QuantMode | None = None,
    ) -> DeepseekV41Model:
        """Load a dsv4cp export (`save_pretrained`, `export-tiny`). `quant` None: the export's
        own numerics (`default_quant`: "qat" when config.json has a quantization_config, as the
        server's default), so a saved qat model reloads as qat."""
        from safetensors.torch import load_file

        if checkpoint_kind(path) != "export":
            raise ValueError(
                f"from_pretrained: {os.fspath(path)} is a released DeepSeek-V4.1 checkpoint "
                "(config.json model_type 'deepseek_v41'); load it with from_checkpoint"
            )
        config = DeepseekV41Config.from_hf(path)
        mode = default_quant(config) if quant is None else quant
        model = cls(config, dtype=dtype, device=device, seed=None, quant=mode)
        model.load_state(load_file(os.path.join(path, WEIGHTS_FILE)))
        return model

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike[str],
        *,
        quant: str = "qat",
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        ep: CPGroup | None = None,
    ) -> DeepseekV41Model:
        """Load a released-format DeepSeek-V4.1 checkpoint directory (`loader.load_checkpoint`);
        with `ep` only this rank's experts are read."""
        from dsv4cp.loader import load_checkpoint

        if os.path.exists(path) and not os.path.isdir(path):  # e.g. its index or config.json
            raise CheckpointError(not_a_checkpoint_dir(path))
        try:
            kind = checkpoint_kind(path)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        if kind != "released":
            raise CheckpointError(
                f"{os.fspath(path)} is a dsv4cp export (config.json model_type "
                f"{EXPORT_MODEL_TYPE!r}), not a released-format checkpoint: the CLI's "
                "--checkpoint reads released checkpoints only; in Python, load an export with "
                "DeepseekV41Model.from_pretrained"
            )
        config = DeepseekV41Config.from_hf(path)
        model = cls(config, dtype=dtype, device=device, seed=None, quant=quant, ep=ep)
        load_checkpoint(model, Path(path))
        return model

    def prepare_lanes(self) -> list[str]:
        """The side lanes of every layer's prepare: one CUDA stream each (`StreamPool`)."""
        return lanes_of([block.attn.schedule() for block in self.blocks])

    # ------------------------------------------------------------------ forward
    def forward(
        self, input_ids: Tensor, ctx: ForwardContext, executors: LayerExecutors = SERIAL_ONLY
    ) -> Tensor:
        """Global token ids [T] of the batch → global hidden rows [T, d] after the last block and
        the final collapse (before the final norm), on every rank. Ids are validated by the
        caller (the runner before reserving slots, SGLang before scheduling)."""
        h = self.embed_local(input_ids, ctx.local_ids)
        hash_ids = self._engram_hash_ids(input_ids, ctx)
        h = self.forward_hidden(h, ctx, executors, hash_ids)
        return gather_global(ctx.cp, ctx.layout, h, tag="final/hidden")

    def embed_local(self, input_ids: Tensor, local_ids: Tensor) -> Tensor:
        """Embeddings of this rank's rows: global token `local_ids[i]`, token 0 on padding."""
        ids = torch.where(local_ids >= 0, input_ids[local_ids.clamp(min=0)], 0)
        return F.embedding(ids, self.embed)

    def _engram_hash_ids(self, input_ids: Tensor, ctx: ForwardContext) -> Tensor | None:
        """Write the batch's ids to the slot store, then hash this rank's rows (row-local)."""
        if not self.engram_layers:
            return None
        hashes = self.engram_hashes
        if hashes is None:
            raise ValueError(
                "the model has Engram layers but no hasher/tables (attach_engram, or load with "
                "from_checkpoint)"
            )
        store = ctx.cache.token_ids
        with stage("engram_hash"):
            hashes.write(store, ctx, input_ids)
            return hashes.local_ids(store, ctx)

    def forward_hidden(
        self,
        h: Tensor,
        ctx: ForwardContext,
        executors: LayerExecutors = SERIAL_ONLY,
        hash_ids: Tensor | None = None,
    ) -> Tensor:
        """Local embedding rows [P, d] through every block, then the final collapse: [P, d]."""
        hc = self.config.hc_mult
        pre: Tensor | None = None
        if hc > 1:
            pre = identity_pre(ctx.local_ids, hc)
            h = hc_expand_embedding(h, hc)
        for block in self.blocks:
            if self.block_input_hook is not None:
                h, pre = self.block_input_hook(block.layer, h, pre, ctx)
            h, pre = block(h, pre, ctx, executors.for_role(block.attn.role), hash_ids)
            if self.check_finite and not _capturing(h):
                check_finite(h, f"hidden rows after layer {block.layer}", row_ids=ctx.local_ids)
            if self.layer_hook is not None:
                self.layer_hook(f"layer{block.layer}", h, ctx)
        if pre is None:
            return h
        with stage("mhc"):
            return hc_collapse(h, pre)

    def index_scores(self, layer: int, x: Tensor, ctx: ForwardContext) -> Tensor:
        """Recompute index source `layer`'s scores [L, width] of this rank's rows from its
        attention input x, after the layer ran in `ctx` (its index keys are in the
        cache): for top-k tie checks (`tools.reference_check`), not the forward path."""
        attn = self.blocks[layer].attn
        if not attn.role.index_source:
            raise ValueError(f"layer {layer} is not an index source")
        return attn.index_logits(*attn.index_queries(x, ctx), ctx)

    def logits(self, h: Tensor) -> Tensor:
        """fp32 logits [..., V]: the final norm in the model dtype, then the fp32 head."""
        return linear_rows(rms_norm(h, self.norm, self.config.rms_norm_eps).float(), self.head)
