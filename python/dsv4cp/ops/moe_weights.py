"""How the MoE's weights are held: one projection as stored (fp8 + block scales, packed fp4 +
scales, or plain) and the routed experts' projections stacked along a leading expert dimension
(packed fp4 + e8m0 scales), with the check of a stack's layout."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class QuantWeight(NamedTuple):
    """One projection as stored: fp8 [out, in] + e8m0 [⌈out/32⌉, ⌈in/32⌉], packed fp4 int8
    [out, in/2] + e8m0 [out, in/32], or a plain float weight with ``scale`` None."""

    weight: Tensor
    scale: Tensor | None


class ExpertStack(NamedTuple):
    """One projection of all routed experts: packed fp4 [E, out, in/2] + e8m0 [E, out, in/32]."""

    weight: Tensor
    scale: Tensor

    def expert(self, e: int) -> QuantWeight:
        return QuantWeight(self.weight[e], self.scale[e])


def stack_shape(name: str, stack: ExpertStack, n_experts: int) -> tuple[int, int]:
    """(out, in) of a packed fp4 stack [E, out, in/2] with scales [E, out, in/32]; a ValueError
    naming `name` otherwise."""
    w, s = stack
    if w.dim() != 3 or w.shape[0] != n_experts or s.dim() != 3 or s.shape[:2] != w.shape[:2]:
        raise ValueError(
            f"{name}: expected packed fp4 [{n_experts}, out, in/2] with scales [{n_experts}, out, "
            f"in/32], got {tuple(w.shape)} and {tuple(s.shape)}"
        )
    return w.shape[1], w.shape[2] * 2
