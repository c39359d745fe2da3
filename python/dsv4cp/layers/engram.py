"""`Engram`: one Engram layer's projection and gate weights, with its table kept on the host."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dsv4cp.layers.linear import Linear
from dsv4cp.ops.engram import RowSource, engram
from dsv4cp.ops.linear import WEIGHT_BLOCK
from dsv4cp.ops.quant import QuantMode

TABLE_NAMES = ("embed.weight", "embed.scale")  # read through attach_table, not checkpoint_slots


class Engram(nn.Module):
    """``wkv`` fp8 [(H+1)·d, cols·head_dim], ``q_weight`` / ``k_weight`` bf16 [H, d]; the fp8
    table [rows, head_dim] and its e8m0 scales [rows, head_dim/32] stay where they are (a host
    tensor or a memmap of the shard: ``attach_table``) and only looked-up rows move."""

    def __init__(
        self, config: Any, layer_id: int, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        layer_ids = tuple(config.engram_layer_ids)
        if layer_id not in layer_ids:
            raise ValueError(f"Engram: layer {layer_id} is not in engram_layer_ids {layer_ids}")
        self.layer_id = layer_id
        self.hash_index = layer_ids.index(layer_id)  # this layer's slot in NgramHasher.hash
        self.num_rows = config.engram_num_embeddings[self.hash_index]
        self.head_dim = config.engram_head_dim
        if self.head_dim % WEIGHT_BLOCK:
            raise ValueError(f"engram_head_dim {self.head_dim} is not a multiple of 32")
        self.n_cols = (config.engram_max_ngram_size - 1) * config.engram_n_heads
        self.norm_eps = config.rms_norm_eps
        hc, d = config.hc_mult, config.hidden_size
        self.wkv = Linear(
            self.n_cols * self.head_dim, (hc + 1) * d, storage="fp8", dtype=dtype, device=device
        )
        ones = torch.ones(hc, d, dtype=torch.bfloat16, device=device)
        self.q_weight = nn.Parameter(ones.clone(), requires_grad=False)
        self.k_weight = nn.Parameter(ones, requires_grad=False)
        self.table: tuple[RowSource, RowSource] | None = None

    def attach_table(self, weight: RowSource, scale: RowSource) -> None:
        """Use this table: codes [rows, head_dim] (fp8, or uint8 bytes of a memmap) and e8m0
        scales [rows, head_dim/32]."""
        want_w, want_s = (self.num_rows, self.head_dim), (self.num_rows, self.head_dim // 32)
        if tuple(weight.shape) != want_w or tuple(scale.shape) != want_s:
            raise ValueError(
                f"Engram layer {self.layer_id}: table must be {want_w} with scales {want_s}, got "
                f"{tuple(weight.shape)} and {tuple(scale.shape)}"
            )
        self.table = (weight, scale)

    def forward(
        self,
        x: Tensor,
        hash_ids: Tensor,
        token_mask: Tensor | None = None,
        quant: QuantMode = "qat",
    ) -> Tensor:
        """Streams x [T, H, d], this layer's hash ids [T, cols] → streams [T, H, d]."""
        if self.table is None:
            raise ValueError(f"Engram layer {self.layer_id}: no table attached (attach_table)")
        if hash_ids.shape[-1] != self.n_cols:
            raise ValueError(
                f"Engram layer {self.layer_id}: hash_ids must have {self.n_cols} "
                f"columns, got {hash_ids.shape[-1]}"
            )
        return engram(
            x,
            hash_ids,
            table_weight=self.table[0],
            table_scale=self.table[1],
            wkv=(self.wkv.weight, self.wkv.scale),
            q_weight=self.q_weight,
            k_weight=self.k_weight,
            norm_eps=self.norm_eps,
            quant=quant,
            token_mask=token_mask,
        )

    def checkpoint_slots(self, prefix: str) -> dict[str, Tensor]:
        """Checkpoint name → destination tensor (the table excluded: see ``TABLE_NAMES``);
        prefix e.g. ``"layers.1.engram."``."""
        return {
            f"{prefix}wkv.weight": self.wkv.weight,
            f"{prefix}wkv.scale": self.wkv.scale,  # type: ignore[dict-item]
            f"{prefix}q_weight": self.q_weight,
            f"{prefix}k_weight": self.k_weight,
        }
