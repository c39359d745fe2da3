"""The V4.1 MoE: sqrtsoftplus routing, grouped routed experts, the shared expert, the combine.

Math (DeepSeek reference ``model.py``: ``Gate.forward``, ``Expert.forward``, ``MoE.forward``):

- scores s = sqrt(softplus(x·Wgᵀ / gate_temp)) in fp32 (or sigmoid / softmax);
- experts = the ``top_k`` largest s + bias (the bias steers the choice only); exact ties go to the
  smaller expert index (a stable sort, the same on every device);
- weights = s at the chosen experts, divided by their sum + 1e-20 when ``norm_topk_prob`` (and
  top_k > 1), times ``routed_scaling_factor``;
- expert(x) = W2 · (w · silu(min(W1x, L)) · clamp(W3x, -L, L)) with L = ``swiglu_limit`` (no
  clamp when L = 0); the routing weight multiplies *before* W2, in fp32, then rounds to x.dtype;
- y = Σ routed outputs in ascending expert order + the shared expert, accumulated in fp32,
  rounded to x.dtype once.

Every GEMM goes through ``dsv4cp.ops.linear.linear`` (``quant="qat"``: fp8 activation blocks of
32 with power-of-two scales before the fp4 / fp8 weight, fp32 accumulation, output in x.dtype;
``"none"``: the dequantized weight in x.dtype). The routed experts are grouped: token-expert pairs
are sorted by expert so that each expert's rows are one contiguous slice (``grouped_expert_mlp``).
All of it is per token, so context parallelism cannot change it. Expert parallelism (docs/ep.md)
reuses `combine`, and its twins in `ops/moe_ep.py` give every expert the rows, in the order, that
it gets here.

Files: this one composes the layer (`moe`: route → routed experts per token → `combine`);
`moe_routing.py` the gate (`MoeSpec`, `route`, `sort_by_expert`), `moe_experts.py` the expert
GEMMs (`expert_mlp`, `grouped_expert_mlp`), `moe_weights.py` the weights as stored
(`QuantWeight`, `ExpertStack`), `moe_ep.py` expert parallelism.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dsv4cp.ops.moe_experts import (
    TORCH_EXPERT_KERNELS,
    ExpertKernels,
    GroupedBackend,
    expert_mlp,
    grouped_expert_mlp,
)
from dsv4cp.ops.moe_routing import MoeSpec, Routing, route, sort_by_expert
from dsv4cp.ops.moe_weights import ExpertStack, QuantWeight
from dsv4cp.ops.quant import QuantMode


def routed_per_token(
    x: Tensor,
    routing: Routing,
    experts: tuple[ExpertStack, ExpertStack, ExpertStack],
    spec: MoeSpec,
    quant: QuantMode,
    backend: GroupedBackend = "auto",
    kernels: ExpertKernels = TORCH_EXPERT_KERNELS,
) -> Tensor:
    """Every token's routed expert outputs x.dtype [T, k, d], slot j = its j-th (ascending)
    expert, weighted by its routing weight (all experts held here: expert parallelism = 1)."""
    k = spec.num_experts_per_tok
    order, counts = sort_by_expert(routing, spec.n_routed_experts)
    pair_out = grouped_expert_mlp(
        x[order // k],
        counts,
        *experts,
        route_weight=routing.weights.flatten()[order],
        swiglu_limit=spec.swiglu_limit,
        quant=quant,
        backend=backend,
        kernels=kernels,
    )
    per_token = torch.empty_like(pair_out)
    per_token[order] = pair_out
    return per_token.view(x.shape[0], k, -1)


def combine(per_token: Tensor, shared_out: Tensor, dtype: torch.dtype) -> Tensor:
    """y = Σ_j per_token[:, j] in ascending expert order + the shared expert, in fp32, rounded
    to `dtype` once (the reference's accumulation; expert parallelism keeps it)."""
    y = per_token[:, 0].float()
    for j in range(1, per_token.shape[1]):
        y = y + per_token[:, j].float()
    return (y + shared_out.float()).to(dtype)


def moe(
    x: Tensor,
    *,
    gate_weight: Tensor,
    gate_bias: Tensor | None,
    experts: tuple[ExpertStack, ExpertStack, ExpertStack],
    shared: tuple[QuantWeight, QuantWeight, QuantWeight],
    spec: MoeSpec,
    quant: QuantMode,
    backend: GroupedBackend = "auto",
    shared_mlp: Callable[[Tensor], Tensor] | None = None,
    kernels: ExpertKernels = TORCH_EXPERT_KERNELS,
) -> Tensor:
    """The whole MoE on x [T, d] (the ffn_norm output) → x.dtype [T, d]. ``experts``/``shared``
    are the (w1, w3, w2) projections: w1 gate, w3 up, w2 down. ``shared_mlp``, when given,
    computes the shared expert instead of ``expert_mlp`` on ``shared`` (the layer's routed fp8
    kernels on CUDA; the same math)."""
    if x.dim() != 2:
        raise ValueError(f"moe: x must be [T, d], got {tuple(x.shape)}")
    routing = route(x, gate_weight, gate_bias, spec, kernels.gate_linear)
    per_token = routed_per_token(x, routing, experts, spec, quant, backend, kernels)
    if shared_mlp is None:
        shared_out = expert_mlp(x, *shared, swiglu_limit=spec.swiglu_limit, quant=quant)
    else:
        shared_out = shared_mlp(x)
    return combine(per_token, shared_out, x.dtype)
