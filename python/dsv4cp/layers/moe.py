"""`MoE`: the gate, the stacked fp4 routed experts and the fp8 shared expert of one layer, with
expert parallelism (EP) over a group when it is given one (docs/ep.md): each rank holds
`n_routed_experts / ep_size` consecutive experts, and the token-expert pairs of its rows go to
the ranks holding their experts and come back through `all_to_all` on that group."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from dsv4cp.cp.group import CPGroup, split_matrix
from dsv4cp.layers.linear import Linear
from dsv4cp.ops.linear import WEIGHT_BLOCK
from dsv4cp.ops.moe import combine, moe
from dsv4cp.ops.moe_ep import ep_dispatch, ep_local_experts, ep_pack, ep_per_token
from dsv4cp.ops.moe_experts import ExpertKernels, GroupedBackend, clamped_swiglu
from dsv4cp.ops.moe_routing import MoeSpec, route
from dsv4cp.ops.moe_weights import ExpertStack, QuantWeight
from dsv4cp.ops.quant import QuantMode
from dsv4cp.routing import dequant_fp4, fake_act_quant_fp8, grouped_fp4_mm, rowwise_linear_fp32

_PROJECTIONS = ("w1", "w3", "w2")  # gate, up, down
ROUTED_EXPERT_KERNELS = ExpertKernels(  # Triton on CUDA
    dequant_fp4, fake_act_quant_fp8, rowwise_linear_fp32, grouped_fp4_mm
)
_UE8M0_ONE = 127


def _frozen(t: Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def expert_range(n_experts: int, ep: CPGroup | None) -> range:
    """The routed experts rank `ep.rank` holds: the whole range without EP (or EP size 1), else
    the rank's contiguous `n_experts / ep_size` (a ValueError when ep_size does not divide)."""
    if ep is None or ep.cp_size == 1:
        return range(n_experts)
    n = ep.cp_size
    if n_experts % n:
        raise ValueError(
            f"expert parallelism over {n} ranks: n_routed_experts={n_experts} is not a "
            f"multiple of {n} (each rank holds n_routed_experts / ranks consecutive experts)"
        )
    per = n_experts // n
    return range(ep.rank * per, (ep.rank + 1) * per)


class MoE(nn.Module):
    """Weights in checkpoint storage: ``gate_weight`` bf16 [E, d], ``gate_bias`` fp32 [E]; routed
    ``w{1,3,2}_weight`` int8 [E, out, in/2] (packed e2m1) with ``w*_scale`` e8m0 [E, out, in/32];
    the shared expert as three fp8 ``Linear``. ``dtype`` is the activation / output dtype.
    ``gate.bias_vl`` (the image-token bias) is not read: text tokens only.

    ``ep``: the expert-parallel group (None or size 1: every expert here). The stacks then hold
    only ``experts`` (`expert_range`), E/N of them; the gate and the shared expert are
    replicated. ``layer`` names the exchanges for the order guard ("layer3/ep_dispatch")."""

    def __init__(
        self,
        config: Any,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        ep: CPGroup | None = None,
        layer: int = 0,
    ) -> None:
        super().__init__()
        self.spec = MoeSpec.from_config(config)
        self.layer = layer
        self.ep = ep if ep is not None and ep.cp_size > 1 else None
        self.experts = expert_range(self.spec.n_routed_experts, self.ep)
        e_all, d, inter = (
            self.spec.n_routed_experts,
            config.hidden_size,
            config.moe_intermediate_size,
        )
        e = len(self.experts)
        self.gate_weight = _frozen(torch.zeros(e_all, d, dtype=torch.bfloat16, device=device))
        self.gate_bias = _frozen(torch.zeros(e_all, dtype=torch.float32, device=device))
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
        the math of `ops.moe_experts.expert_mlp`."""
        lin = {n: self.shared[n] for n in _PROJECTIONS}
        h = clamped_swiglu(lin["w1"](x, quant), lin["w3"](x, quant), self.spec.swiglu_limit)
        return cast(Tensor, lin["w2"](h.to(x.dtype), quant))

    def forward(
        self,
        x: Tensor,
        quant: QuantMode = "qat",
        backend: GroupedBackend = "auto",
        row_ids: Tensor | None = None,
    ) -> Tensor:
        """x [T, d] (the ffn_norm output) → [T, d] in x.dtype. ``row_ids`` (the global token of
        each row, -1 for CP padding; `ForwardContext.local_ids`) is read with EP only: padding
        rows send nothing (their routed part is 0) and owners order rows by it."""
        if self.ep is not None:
            return self._forward_ep(x, quant, backend, row_ids)
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
            kernels=ROUTED_EXPERT_KERNELS,
        )

    def _forward_ep(
        self, x: Tensor, quant: QuantMode, backend: GroupedBackend, row_ids: Tensor | None
    ) -> Tensor:
        """Route here (the gate is replicated) → dispatch every pair to its expert's rank →
        this rank's experts on what it received → the outputs back → combine as EP = 1 (the
        same per-pair values, summed in the same order and dtype). Collectives per layer, in
        this order on every rank: the counts' all_gather, the dispatch and the combine."""
        ep = self.ep
        assert ep is not None
        if x.dim() != 2:
            raise ValueError(f"moe: x must be [T, d], got {tuple(x.shape)}")
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise NotImplementedError(
                "expert parallelism under CUDA graph capture: the exchange sizes are read on "
                "the host (docs/ep.md, 'CUDA graphs'); run EP eagerly"
            )
        if row_ids is not None and row_ids.shape != x.shape[:1]:
            raise ValueError(f"moe: row_ids must be [{x.shape[0]}], got {tuple(row_ids.shape)}")
        spec, tag = self.spec, f"layer{self.layer}"
        routing = route(
            x, self.gate_weight, self.gate_bias, spec, ROUTED_EXPERT_KERNELS.gate_linear
        )
        per_rank = len(self.experts)
        plan = ep_dispatch(routing, row_ids, ep.cp_size, per_rank)
        splits = split_matrix(ep, plan.counts, tag=f"{tag}/ep_counts")  # the one host sync
        pairs = plan.order[: sum(splits[ep.rank])]
        rows = ep_pack(x, routing, row_ids, pairs, per_rank)
        received = ep.all_to_all(rows, splits, tag=f"{tag}/ep_dispatch")
        stacks = (self.stack("w1"), self.stack("w3"), self.stack("w2"))
        out = ep_local_experts(
            received, x.dtype, stacks, spec, quant, backend, ROUTED_EXPERT_KERNELS
        )
        back = [list(col) for col in zip(*splits)]  # the transposed matrix: results go home
        pair_out = ep.all_to_all(out, back, tag=f"{tag}/ep_combine")
        per_token = ep_per_token(pair_out, pairs, x.shape[0], spec.num_experts_per_tok)
        return combine(per_token, self.shared_mlp(x, quant), x.dtype)

    def checkpoint_slots(self, prefix: str) -> dict[str, Tensor]:
        """Checkpoint name → destination tensor (views into the expert stacks); prefix is the
        FFN's, e.g. ``"layers.3.ffn."``. With EP only this rank's experts (global numbers)."""
        slots: dict[str, Tensor] = {
            f"{prefix}gate.weight": self.gate_weight,
            f"{prefix}gate.bias": self.gate_bias,
        }
        for name in _PROJECTIONS:
            weight, scale = self.stack(name)
            for i, e in enumerate(self.experts):
                slots[f"{prefix}experts.{e}.{name}.weight"] = weight[i]
                slots[f"{prefix}experts.{e}.{name}.scale"] = scale[i]
            shared = self._shared(name)
            assert shared.scale is not None
            slots[f"{prefix}shared_experts.{name}.weight"] = shared.weight
            slots[f"{prefix}shared_experts.{name}.scale"] = shared.scale
        return slots

    def foreign_expert_slots(self, prefix: str) -> dict[str, Tensor]:
        """Scratch tensors for the experts other EP ranks hold, under their checkpoint names:
        seeded random weights draw every tensor in name order (`init_random_`), so a rank
        draws these too (and drops them) to get the values EP = 1 gets."""
        out: dict[str, Tensor] = {}
        for name in _PROJECTIONS:
            weight, scale = self.stack(name)
            for e in range(self.spec.n_routed_experts):
                if e not in self.experts:
                    out[f"{prefix}experts.{e}.{name}.weight"] = torch.empty_like(weight[0])
                    out[f"{prefix}experts.{e}.{name}.scale"] = torch.empty_like(scale[0])
        return out
