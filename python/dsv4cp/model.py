"""`DeepseekV41Model`: a V4.1-shaped decoder (embedding, attention + dense SwiGLU blocks, norm,
head) and its one forward, shared by `PrefillRunner` (eager and graph capture) and the SGLang
adapter: local token ids → embedding → every layer → the gather of the last hidden rows.

MoE, mHC and engrams are not here yet: the FFN is a dense SwiGLU. Save/load is a directory with
`config.json` (HF layout, nested `text_config`) and `model.safetensors` with DeepSeek's
attention weight names.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv4cp.config import DeepseekV41Config
from dsv4cp.context import ForwardContext
from dsv4cp.cp.group import gather_global
from dsv4cp.executors import SERIAL, SERIAL_ONLY, Executor, LayerExecutors
from dsv4cp.layers.attention import DeepseekV41Attention
from dsv4cp.observe.timing import stage
from dsv4cp.ops import check_quant_mode, rms_norm
from dsv4cp.ops.finite import check_finite, finite_check_requested
from dsv4cp.schedule import lanes_of

WEIGHTS_FILE = "model.safetensors"
# (name, this rank's output rows of the layer, the forward's context): see `layer_hook`.
LayerHook = Callable[[str, Tensor, ForwardContext], None]


@torch.no_grad()
def init_random_(
    weights: Mapping[str, Tensor],
    config: DeepseekV41Config,
    seed: int,
    *,
    device: torch.device | str = "cpu",
) -> None:
    """Fill checkpoint-named weights in place, in name order, from one generator on `device`:
    the CPU (default) gives every device the same values; "cuda" is fast at Flash dims (the
    benchmarks). Norms 1 + N(0, 0.01), embedding and sinks N(0, 1), matrices N(0, 1/fan_in).

    Index head 2m+1's query projection is the negative of head 2m's, so at least one head of
    each pair is active and index scores have no exact-zero ties (attention-math erratum 2).
    """
    g = torch.Generator(device=device).manual_seed(seed)
    for name, t in sorted(weights.items()):
        val = torch.randn(t.shape, generator=g, device=device)
        if name.endswith("norm.weight"):
            val = 1.0 + 0.1 * val
        elif not (name.endswith("attn_sink") or name == "embed.weight"):
            val = val / math.sqrt(t.shape[-1])
        if name.endswith("indexer.wq_b.weight"):
            h, dim = config.index_n_heads, config.index_head_dim
            v = val.view(h, dim, -1)
            v[1::2] = -v[0::2][: h // 2]
        t.copy_(val.to(t.dtype))


def _capturing(t: Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class SwiGLU(nn.Module):
    def __init__(
        self, d: int, inter: int, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(inter, d, dtype=dtype, device=device), False)
        self.w3 = nn.Parameter(torch.empty(inter, d, dtype=dtype, device=device), False)
        self.w2 = nn.Parameter(torch.empty(d, inter, dtype=dtype, device=device), False)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(F.silu(F.linear(x, self.w1)) * F.linear(x, self.w3), self.w2)


class DecoderLayer(nn.Module):
    def __init__(
        self, config: DeepseekV41Config, i: int, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        d = config.hidden_size
        self.eps = config.rms_norm_eps
        self.attn_norm = nn.Parameter(
            torch.empty(d, dtype=dtype, device=device), requires_grad=False
        )
        self.ffn_norm = nn.Parameter(
            torch.empty(d, dtype=dtype, device=device), requires_grad=False
        )
        self.attn = DeepseekV41Attention(config, i, dtype=dtype, device=device)
        self.ffn = SwiGLU(d, config.intermediate_size, dtype=dtype, device=device)

    def forward(self, h: Tensor, ctx: ForwardContext, executor: Executor = SERIAL) -> Tensor:
        with stage("attention", layer=self.attn.layer, timed=False):
            h = h + self.attn(rms_norm(h, self.attn_norm, self.eps), ctx, executor)
        with stage("ffn", layer=self.attn.layer):
            return h + self.ffn(rms_norm(h, self.ffn_norm, self.eps))


class DeepseekV41Model(nn.Module):
    """`layer_hook`, when set (by `tools.checking`), sees every layer's output rows; the runner
    then runs eagerly, since a graph replay keeps no intermediate rows."""

    def __init__(
        self,
        config: DeepseekV41Config,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        seed: int | None = 0,
        quant: str = "none",
    ) -> None:
        super().__init__()
        self.quant = check_quant_mode(quant)  # only "none" exists yet; the others raise
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        d, v = config.hidden_size, config.vocab_size
        self.embed = nn.Parameter(
            torch.empty(v, d, dtype=dtype, device=device), requires_grad=False
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype=dtype, device=device)
            for i in range(config.num_hidden_layers)
        )
        self.norm = nn.Parameter(torch.empty(d, dtype=dtype, device=device), requires_grad=False)
        self.head = nn.Parameter(torch.empty(v, d, dtype=dtype, device=device), requires_grad=False)
        self.layer_hook: LayerHook | None = None
        # DSV4CP_CHECK_FINITE=1: every layer's output is checked on the host (debugging).
        self.check_finite = finite_check_requested()
        if seed is not None:
            self.init_random(seed)

    @property
    def blocks(self) -> list[DecoderLayer]:
        """The decoder layers, typed (iterating an nn.ModuleList yields plain Modules)."""
        return [cast(DecoderLayer, layer) for layer in self.layers]

    # ------------------------------------------------------------------ weights
    def checkpoint_weights(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {
            "embed.weight": self.embed,
            "norm.weight": self.norm,
            "head.weight": self.head,
        }
        for i, layer in enumerate(self.blocks):
            out[f"layers.{i}.attn_norm.weight"] = layer.attn_norm
            out[f"layers.{i}.ffn_norm.weight"] = layer.ffn_norm
            for n in ("w1", "w2", "w3"):
                out[f"layers.{i}.ffn.{n}.weight"] = getattr(layer.ffn, n)
            for n, t in layer.attn.checkpoint_weights().items():
                out[f"layers.{i}.attn.{n}"] = t
        return out

    def init_random(self, seed: int, *, device: torch.device | str = "cpu") -> None:
        """Deterministic random weights (`init_random_`)."""
        init_random_(self.checkpoint_weights(), self.config, seed, device=device)

    def save_pretrained(self, path: str | os.PathLike[str]) -> None:
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(self.config.to_hf(), f, indent=2)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.checkpoint_weights().items()}
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
    ) -> DeepseekV41Model:
        from safetensors.torch import load_file

        config = DeepseekV41Config.from_hf(path)
        model = cls(config, dtype=dtype, device=device, seed=None)
        model.load_state(load_file(os.path.join(path, WEIGHTS_FILE)))
        return model

    def prepare_lanes(self) -> list[str]:
        """The side lanes of every layer's prepare: one CUDA stream each (`StreamPool`)."""
        return lanes_of([layer.attn.schedule() for layer in self.blocks])

    # ------------------------------------------------------------------ forward
    def forward(
        self, input_ids: Tensor, ctx: ForwardContext, executors: LayerExecutors = SERIAL_ONLY
    ) -> Tensor:
        """Global token ids [T] of the batch → global hidden rows [T, d] after the last layer
        (before the final norm), on every rank. Ids are validated by the caller (the runner
        before reserving slots, SGLang before scheduling)."""
        h = self.embed_local(input_ids, ctx.local_ids)
        h = self.forward_hidden(h, ctx, executors)
        return gather_global(ctx.cp, ctx.layout, h, tag="final/hidden")

    def embed_local(self, input_ids: Tensor, local_ids: Tensor) -> Tensor:
        """Embeddings of this rank's rows: global token `local_ids[i]`, token 0 on padding."""
        ids = torch.where(local_ids >= 0, input_ids[local_ids.clamp(min=0)], 0)
        return F.embedding(ids, self.embed)

    def forward_hidden(
        self, h: Tensor, ctx: ForwardContext, executors: LayerExecutors = SERIAL_ONLY
    ) -> Tensor:
        """Local rows through every decoder layer (no final norm)."""
        for layer in self.blocks:
            h = layer(h, ctx, executors.for_role(layer.attn.role))
            if self.check_finite and not _capturing(h):
                check_finite(
                    h, f"hidden rows after layer {layer.attn.layer}", row_ids=ctx.local_ids
                )
            if self.layer_hook is not None:
                self.layer_hook(f"layer{layer.attn.layer}", h, ctx)
        return h

    def logits(self, h: Tensor) -> Tensor:
        return F.linear(rms_norm(h, self.norm, self.config.rms_norm_eps), self.head).float()
