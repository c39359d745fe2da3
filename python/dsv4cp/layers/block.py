"""`DeepseekV41Block`: one V4.1 block — Engram, the attention sub-layer, the FFN sub-layer — with
the hyper-connection wiring between them (DeepSeek reference ``model.py: Block.forward``,
``Transformer.forward`` for where Engram runs).

Streams: with ``hc_mult = H > 1`` the residual is ``[P, H, d]`` and each sub-layer sits between a
collapse and an expand (`hc_sublayer`: the input collapses with the ``pre`` handed over from the
previous sub-layer, the sub-layer's own mixes give ``post``/``comb`` and the ``pre`` it hands on).
With ``hc_mult = 1`` the residual is a plain ``[P, d]`` row and a sub-layer adds to it (dsv4cp's
small test decoder). The FFN is the MoE when ``n_routed_experts > 0``, else a dense SwiGLU of
``intermediate_size`` (dsv4cp's own, not in the release). Everything here but the attention is
row-local, so CP splits it by rows and cannot change it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv4cp.config import DeepseekV41Config
from dsv4cp.context import ForwardContext
from dsv4cp.cp.group import CPGroup
from dsv4cp.executors import SERIAL, Executor
from dsv4cp.layers.attention import DeepseekV41Attention
from dsv4cp.layers.engram import Engram
from dsv4cp.layers.hyper_connections import HyperConnection, hc_sublayer
from dsv4cp.layers.moe import MoE
from dsv4cp.observe.timing import stage
from dsv4cp.ops.matmul import linear_rows
from dsv4cp.ops.moe_experts import GroupedBackend
from dsv4cp.ops.quant import QuantMode
from dsv4cp.routing import rms_norm


def _frozen(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class DenseFFN(nn.Module):
    """SwiGLU ``w2 · (silu(w1·x) · w3·x)`` in the model dtype: the FFN of configs without MoE (the
    tiny test decoder); names ``ffn.w{1,2,3}.weight`` are dsv4cp's own."""

    def __init__(
        self, d: int, inter: int, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.w1 = _frozen(inter, d, dtype=dtype, device=device)
        self.w3 = _frozen(inter, d, dtype=dtype, device=device)
        self.w2 = _frozen(d, inter, dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:
        return linear_rows(F.silu(linear_rows(x, self.w1)) * linear_rows(x, self.w3), self.w2)

    def checkpoint_slots(self, prefix: str) -> dict[str, Tensor]:
        return {f"{prefix}{n}.weight": getattr(self, n) for n in ("w1", "w2", "w3")}


class DeepseekV41Block(nn.Module):
    """Block `layer`: `forward(h, pre, ctx, executor, hash_ids) -> (h, pre)`."""

    def __init__(
        self,
        config: DeepseekV41Config,
        layer: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        quant: QuantMode,
        ep: CPGroup | None = None,
    ) -> None:
        super().__init__()
        c = config
        self.layer, self.quant, self.eps = layer, quant, c.rms_norm_eps
        self.moe_backend: GroupedBackend = "auto"
        d = c.hidden_size
        self.attn_norm = _frozen(d, dtype=dtype, device=device)
        self.ffn_norm = _frozen(d, dtype=dtype, device=device)
        self.attn = DeepseekV41Attention(c, layer, dtype=dtype, device=device, quant=quant)
        self.ffn: MoE | DenseFFN
        if c.n_routed_experts:
            self.ffn = MoE(c, dtype=dtype, device=device, ep=ep, layer=layer)
        else:
            self.ffn = DenseFFN(d, c.intermediate_size, dtype=dtype, device=device)
        self.hc_attn: HyperConnection | None = None
        self.hc_ffn: HyperConnection | None = None
        if c.hc_mult > 1:
            self.hc_attn = HyperConnection(c, "attn", device=device)
            self.hc_ffn = HyperConnection(c, "ffn", device=device)
        self.engram: Engram | None = None
        if layer in c.engram_layer_ids:
            self.engram = Engram(c, layer, dtype=dtype, device=device)

    @property
    def role_name(self) -> str:
        return self.attn.role.name

    # ------------------------------------------------------------------ weights
    def checkpoint_slots(self, prefix: str) -> dict[str, Tensor]:
        """Checkpoint name → destination tensor for everything of this block but the Engram
        table (`Engram.attach_table`); prefix e.g. ``"layers.3."``."""
        slots: dict[str, Tensor] = {
            f"{prefix}attn_norm.weight": self.attn_norm,
            f"{prefix}ffn_norm.weight": self.ffn_norm,
        }
        slots.update(self.attn.checkpoint_slots(f"{prefix}attn."))
        slots.update(self.ffn.checkpoint_slots(f"{prefix}ffn."))
        for hc in (self.hc_attn, self.hc_ffn):
            if hc is not None:
                slots.update(hc.checkpoint_slots(prefix))
        if self.engram is not None:
            slots.update(self.engram.checkpoint_slots(f"{prefix}engram."))
        return slots

    # ------------------------------------------------------------------ forward
    def _attention(self, ctx: ForwardContext, executor: Executor) -> Callable[[Tensor], Tensor]:
        def run(x: Tensor) -> Tensor:
            with stage("attention", layer=self.layer, timed=False):
                return self.attn(rms_norm(x, self.attn_norm, self.eps), ctx, executor)

        return run

    def _ffn(self, ctx: ForwardContext) -> Callable[[Tensor], Tensor]:
        def run(x: Tensor) -> Tensor:
            name = "moe" if isinstance(self.ffn, MoE) else "ffn"
            with stage(name, layer=self.layer):
                y = rms_norm(x, self.ffn_norm, self.eps)
                if isinstance(self.ffn, MoE):
                    return self.ffn(
                        y, quant=self.quant, backend=self.moe_backend, row_ids=ctx.local_ids
                    )
                return cast(Tensor, self.ffn(y))

        return run

    def forward(
        self,
        h: Tensor,
        pre: Tensor | None,
        ctx: ForwardContext,
        executor: Executor = SERIAL,
        hash_ids: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Streams h [P, H, d] (or rows [P, d] when hc_mult = 1) and the `pre` handed over
        (None when hc_mult = 1) → the block's output and the `pre` it hands on. `hash_ids`
        [P, n_engram_layers, cols] are needed when this block has an Engram layer."""
        if self.engram is not None:
            if hash_ids is None:
                raise ValueError(f"block {self.layer}: its Engram layer needs hash ids")
            with stage("engram", layer=self.layer):
                h = self.engram(h, hash_ids[:, self.engram.hash_index], quant=self.quant)
        attention, ffn = self._attention(ctx, executor), self._ffn(ctx)
        if self.hc_attn is None or self.hc_ffn is None:
            h = h + attention(h)
            return h + ffn(h), None
        if pre is None:
            raise ValueError(f"block {self.layer}: hyper-connections need the pre handed over")
        h, pre = hc_sublayer(h, pre, self.hc_attn, attention)
        return hc_sublayer(h, pre, self.hc_ffn, ffn)
