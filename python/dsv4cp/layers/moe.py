"""`MoE`: the gate, the stacked fp4 routed experts and the fp8 shared expert of one layer."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from dsv4cp.layers.linear import Linear
from dsv4cp.ops.linear import WEIGHT_BLOCK
from dsv4cp.ops.moe import (
    ExpertStack,
    GroupedBackend,
    MoeSpec,
    QuantWeight,
    clamped_swiglu,
    moe,
)
from dsv4cp.ops.quant import QuantMode

_PROJECTIONS = ("w1", "w3", "w2")  # gate, up, down
_UE8M0_ONE = 127


def _frozen(t: Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class MoE(nn.Module):
    """Weights in checkpoint storage: ``gate_weight`` bf16 [E, d], ``gate_bias`` fp32 [E]; routed
    ``w{1,3,2}_weight`` int8 [E, out, in/2] (packed e2m1) with ``w*_scale`` e8m0 [E, out, in/32];
    the shared expert as three fp8 ``Linear``. ``dtype`` is the activation / output dtype.
    ``gate.bias_vl`` (the image-token bias) is not read: text tokens only."""

    def __init__(self, config: Any, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.spec = MoeSpec.from_config(config)
        e, d, inter = self.spec.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_weight = _frozen(torch.zeros(e, d, dtype=torch.bfloat16, device=device))
        self.gate_bias = _frozen(torch.zeros(e, dtype=torch.float32, device=device))
        shapes = {"w1": (inter, d), "w3": (inter, d), "w2": (d, inter)}
        for name, (n_out, n_in) in shapes.items():
            if n_in % WEIGHT_BLOCK:
                raise ValueError(f"MoE: {name} in_features {n_in} is not a multiple of 32")
            weight = torch.zeros(e, n_out, n_in // 2, dtype=torch.int8, device=device)
            scale = torch.full(
                (e, n_out, n_in // WEIGHT_BLOCK), _UE8M0_ONE, dtype=torch.uint8, device=device
            ).view(torch.float8_e8m0fnu)
            self.register_parameter(f"{name}_weight", _frozen(weight))
            self.register_buffer(f"{name}_scale", scale)
        self.shared = nn.ModuleDict(
            {
                name: Linear(n_in, n_out, storage="fp8", dtype=dtype, device=device)
                for name, (n_out, n_in) in shapes.items()
            }
        )

    def _shared(self, name: str) -> QuantWeight:
        lin = self.shared[name]
        assert isinstance(lin, Linear)
        return QuantWeight(lin.weight, lin.scale)

    def stack(self, name: str) -> ExpertStack:
        return ExpertStack(getattr(self, f"{name}_weight"), getattr(self, f"{name}_scale"))

    def shared_mlp(self, x: Tensor, quant: QuantMode) -> Tensor:
        """The shared expert through its `Linear`s (the routed fp8 GEMM kernel on CUDA in qat);
        the math of `ops.moe.expert_mlp`."""
        lin = {n: self.shared[n] for n in _PROJECTIONS}
        h = clamped_swiglu(lin["w1"](x, quant), lin["w3"](x, quant), self.spec.swiglu_limit)
        return cast(Tensor, lin["w2"](h.to(x.dtype), quant))

    def forward(
        self, x: Tensor, quant: QuantMode = "qat", backend: GroupedBackend = "auto"
    ) -> Tensor:
        """x [T, d] (the ffn_norm output) → [T, d] in x.dtype."""
        w1, w3, w2 = (self._shared(n) for n in _PROJECTIONS)
        shared = (w1, w3, w2)
        return moe(
            x,
            gate_weight=self.gate_weight,
            gate_bias=self.gate_bias,
            experts=tuple(self.stack(n) for n in _PROJECTIONS),  # type: ignore[arg-type]
            shared=shared,
            spec=self.spec,
            quant=quant,
            backend=backend,
            shared_mlp=lambda y: self.shared_mlp(y, quant),
        )

    def checkpoint_slots(self, prefix: str) -> dict[str, Tensor]:
        """Checkpoint name → destination tensor (views into the expert stacks); prefix is the
        FFN's, e.g. ``"layers.3.ffn."``."""
        slots: dict[str, Tensor] = {
            f"{prefix}gate.weight": self.gate_weight,
            f"{prefix}gate.bias": self.gate_bias,
        }
        for name in _PROJECTIONS:
            weight, scale = self.stack(name)
            for e in range(self.spec.n_routed_experts):
                slots[f"{prefix}experts.{e}.{name}.weight"] = weight[e]
                slots[f"{prefix}experts.{e}.{name}.scale"] = scale[e]
            shared = self._shared(name)
            assert shared.scale is not None
            slots[f"{prefix}shared_experts.{name}.weight"] = shared.weight
            slots[f"{prefix}shared_experts.{name}.scale"] = shared.scale
        return slots
