"""A small DeepSeek-V4.1-shaped decoder: embedding, (attention + dense SwiGLU) blocks, norm, head.

It exists for the demo, tests, benchmarks and SGLang serving. MoE, mHC and engrams are out of
scope: the FFN is a dense SwiGLU. Save/load is a directory with `config.json` (HF layout, nested
`text_config`) and `model.safetensors` with DeepSeek's attention weight names.
"""

from __future__ import annotations

import json
import math
import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv4cp.attention import DeepseekV41Attention
from dsv4cp.config import DeepseekV41Config
from dsv4cp.context import ForwardContext
from dsv4cp.observe.timing import stage
from dsv4cp.ops import check_quant_mode, rms_norm
from dsv4cp.schedule import StreamPool, lanes_of

WEIGHTS_FILE = "model.safetensors"


class SwiGLU(nn.Module):
    def __init__(
        self, d: int, inter: int, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        p = dict(dtype=dtype, device=device)
        self.w1 = nn.Parameter(torch.empty(inter, d, **p), requires_grad=False)
        self.w3 = nn.Parameter(torch.empty(inter, d, **p), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(d, inter, **p), requires_grad=False)

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

    def forward(self, h: Tensor, ctx: ForwardContext) -> Tensor:
        with stage("attention", layer=self.attn.layer, timed=False):
            h = h + self.attn(rms_norm(h, self.attn_norm, self.eps), ctx)
        with stage("ffn", layer=self.attn.layer):
            return h + self.ffn(rms_norm(h, self.ffn_norm, self.eps))


class DeepseekV41ForCausalLM(nn.Module):
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
        if seed is not None:
            self.init_random(seed)

    # ------------------------------------------------------------------ weights
    def checkpoint_weights(self) -> dict[str, Tensor]:
        out = {"embed.weight": self.embed, "norm.weight": self.norm, "head.weight": self.head}
        for i, layer in enumerate(self.layers):
            out[f"layers.{i}.attn_norm.weight"] = layer.attn_norm
            out[f"layers.{i}.ffn_norm.weight"] = layer.ffn_norm
            for n in ("w1", "w2", "w3"):
                out[f"layers.{i}.ffn.{n}.weight"] = getattr(layer.ffn, n)
            for n, t in layer.attn.checkpoint_weights().items():
                out[f"layers.{i}.attn.{n}"] = t
        return out

    @torch.no_grad()
    def init_random(self, seed: int) -> None:
        """Deterministic random weights (CPU generator, so every device gets the same values).

        Index head 2m+1's query projection is the negative of head 2m's, so at least one head of
        each pair is active and index scores have no exact-zero ties (attention-math erratum 2).
        """
        g = torch.Generator().manual_seed(seed)
        cfg = self.config
        for name, t in sorted(self.checkpoint_weights().items()):
            if name.endswith("norm.weight"):
                val = 1.0 + 0.1 * torch.randn(t.shape, generator=g)
            elif name.endswith("attn_sink"):
                val = torch.randn(t.shape, generator=g)
            elif name == "embed.weight":
                val = torch.randn(t.shape, generator=g)
            else:
                val = torch.randn(t.shape, generator=g) / math.sqrt(t.shape[-1])
            if name.endswith("indexer.wq_b.weight"):
                h, dim = cfg.index_n_heads, cfg.index_head_dim
                v = val.view(h, dim, -1)
                v[1::2] = -v[0::2][: h // 2]
            t.copy_(val.to(t.dtype))

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
        for name, t in tensors.items():
            if name not in mine:
                continue
            dst = mine[name]
            if tuple(dst.shape) != tuple(t.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != {tuple(dst.shape)}")
            dst.copy_(t.to(dtype=dst.dtype, device=dst.device))

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> DeepseekV41ForCausalLM:
        from safetensors.torch import load_file

        config = DeepseekV41Config.from_hf(path)
        model = cls(config, dtype=dtype, device=device, seed=None)
        model.load_state(load_file(os.path.join(path, WEIGHTS_FILE)))
        return model

    def stream_pool(self) -> StreamPool:
        """One side stream per lane of any layer's schedule (create once, before capture)."""
        return StreamPool(lanes_of([layer.attn.schedule for layer in self.layers]), self.device)

    # ------------------------------------------------------------------ forward
    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        if input_ids.numel() and (
            int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size
        ):
            raise ValueError(
                f"token id out of range [0, {self.config.vocab_size}): "
                f"min {int(input_ids.min())}, max {int(input_ids.max())}"
            )
        return F.embedding(input_ids, self.embed)

    def forward_hidden(self, h: Tensor, ctx: ForwardContext) -> Tensor:
        """Local rows through every decoder layer (no final norm)."""
        for layer in self.layers:
            h = layer(h, ctx)
            if ctx.record is not None:
                ctx.record[f"layer{layer.attn.layer}"] = h
        return h

    def logits(self, h: Tensor) -> Tensor:
        return F.linear(rms_norm(h, self.norm, self.config.rms_norm_eps), self.head).float()
