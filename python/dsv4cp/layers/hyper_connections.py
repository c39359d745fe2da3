"""`HyperConnection`: one sublayer's mHC mixing map, and the V4.1 sublayer wiring around it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor, nn

from dsv4cp.observe.timing import stage
from dsv4cp.ops.hyper_connections import HcMixes, hc_mixes
from dsv4cp.routing import hc_collapse, hc_expand, hc_mix_logits, sinkhorn_split

__all__ = ["HyperConnection", "hc_collapse", "hc_expand", "hc_sublayer"]

Sublayer = Literal["attn", "ffn"]


class HyperConnection(nn.Module):
    """The ``hc_{attn,ffn}_{fn,base,scale}`` weights (fp32, as stored) of one sublayer.

    Calling it on the streams x [..., H, d] entering the sublayer gives its ``HcMixes``.
    """

    def __init__(self, config: Any, sublayer: Sublayer, *, device: torch.device | str) -> None:
        super().__init__()
        if sublayer not in ("attn", "ffn"):
            raise ValueError(f"HyperConnection: sublayer must be 'attn' or 'ffn', got {sublayer!r}")
        self.sublayer = sublayer
        self.hc_mult = hc = config.hc_mult
        self.sinkhorn_iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        mix = (2 + hc) * hc
        f32 = torch.float32
        self.fn = nn.Parameter(
            torch.zeros(mix, hc * config.hidden_size, dtype=f32, device=device), requires_grad=False
        )
        self.base = nn.Parameter(torch.zeros(mix, dtype=f32, device=device), requires_grad=False)
        self.scale = nn.Parameter(torch.zeros(3, dtype=f32, device=device), requires_grad=False)

    def forward(self, x: Tensor) -> HcMixes:
        return hc_mixes(
            x,
            self.fn,
            self.base,
            self.scale,
            norm_eps=self.norm_eps,
            sinkhorn_iters=self.sinkhorn_iters,
            hc_eps=self.hc_eps,
            mix_logits=hc_mix_logits,
            split=sinkhorn_split,
        )

    def checkpoint_slots(self, prefix: str) -> dict[str, Tensor]:
        """Checkpoint name → destination tensor; prefix is the block's, e.g. ``"layers.3."``."""
        name = f"{prefix}hc_{self.sublayer}_"
        return {name + "fn": self.fn, name + "base": self.base, name + "scale": self.scale}


def hc_sublayer(
    x: Tensor, pre: Tensor, connection: HyperConnection, sublayer: Callable[[Tensor], Tensor]
) -> tuple[Tensor, Tensor]:
    """Run one sublayer (its norm included in ``sublayer``) between the H streams x [T, H, d].

    V4.1's rule (reference ``model.py: Block.forward``): the sublayer's input is x collapsed with
    ``pre`` handed over from the *previous* sublayer (identity_pre before the first block); the
    sublayer's own mixes give ``post``/``comb`` for its output and the ``pre`` it hands on.
    Returns (new streams, the pre for the next sublayer or for the final collapse). The mixing
    runs under the stage "mhc" (the sublayer names its own stages).
    """
    with stage("mhc"):
        mixes = connection(x)
        collapsed = hc_collapse(x, pre)
    y = sublayer(collapsed)
    with stage("mhc"):
        return hc_expand(y, x, mixes.post, mixes.comb), mixes.pre
