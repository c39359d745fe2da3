"""The MoE gate: each token's affinity for each routed expert, the ``top_k`` experts it goes to
and their weights (DeepSeek reference ``model.py``: ``Gate.forward``), and the grouping of the
token-expert pairs by expert that the grouped experts take. `MoeSpec` holds one MoE layer's
routing and expert constants. The math is in `dsv4cp.ops.moe`'s docstring."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from dsv4cp.ops.rowwise import rowwise_linear_fp32

ScoringFunc = Literal["sqrtsoftplus", "sigmoid", "softmax"]
SCORING_FUNCS: tuple[str, ...] = ("sqrtsoftplus", "sigmoid", "softmax")
_NORM_EPS = 1e-20  # the reference's (training's) constant, not rms_norm_eps


@dataclass(frozen=True)
class MoeSpec:
    """The routing and expert constants of one MoE layer (HF ``text_config`` names)."""

    n_routed_experts: int
    num_experts_per_tok: int
    scoring_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    swiglu_limit: float = 0.0

    def __post_init__(self) -> None:
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}"
            )
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok must be in 1..n_routed_experts={self.n_routed_experts}, "
                f"got {self.num_experts_per_tok}"
            )
        if self.gate_temp <= 0:
            raise ValueError(f"gate_temp must be > 0, got {self.gate_temp}")
        if self.swiglu_limit < 0:
            raise ValueError(f"swiglu_limit must be >= 0, got {self.swiglu_limit}")

    @classmethod
    def from_config(cls, config: Any) -> MoeSpec:
        """Read the fields off a config object (``DeepseekV41Config`` or any namespace)."""
        if getattr(config, "n_shared_experts", 1) != 1:
            raise ValueError(
                f"n_shared_experts must be 1 (one shared expert), got {config.n_shared_experts}"
            )
        return cls(
            n_routed_experts=config.n_routed_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            scoring_func=config.scoring_func,
            gate_temp=config.gate_temp,
            norm_topk_prob=config.norm_topk_prob,
            routed_scaling_factor=config.routed_scaling_factor,
            swiglu_limit=config.swiglu_limit,
        )


class Routing(NamedTuple):
    """Per token: the chosen experts (int64 [T, k], ascending) and their weights (fp32 [T, k])."""

    experts: Tensor
    weights: Tensor


def gate_scores(
    x: Tensor,
    gate_weight: Tensor,
    *,
    scoring_func: str,
    gate_temp: float,
    linear: Callable[[Tensor, Tensor], Tensor] = rowwise_linear_fp32,
) -> Tensor:
    """fp32 [T, E] affinities of each token for each routed expert; `linear` is the row-local
    fp32 GEMM (the twin, or its kernel on CUDA)."""
    logits = linear(x, gate_weight) / gate_temp  # row-local bit for bit
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    if scoring_func == "softmax":
        return logits.softmax(dim=-1)
    raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {scoring_func!r}")


def route(
    x: Tensor,
    gate_weight: Tensor,
    gate_bias: Tensor | None,
    spec: MoeSpec,
    linear: Callable[[Tensor, Tensor], Tensor] = rowwise_linear_fp32,
) -> Routing:
    """Pick ``top_k`` experts per token by scores + bias; weight them by the unbiased scores
    (`linear`: the gate's row-local fp32 GEMM, `gate_scores`)."""
    if gate_weight.shape != (spec.n_routed_experts, x.shape[-1]):
        raise ValueError(
            f"route: gate weight must be [{spec.n_routed_experts}, {x.shape[-1]}], "
            f"got {tuple(gate_weight.shape)}"
        )
    scores = gate_scores(
        x, gate_weight, scoring_func=spec.scoring_func, gate_temp=spec.gate_temp, linear=linear
    )
    select = scores if gate_bias is None else scores + gate_bias.float()
    order = torch.sort(select, dim=-1, descending=True, stable=True).indices
    experts = order[:, : spec.num_experts_per_tok].sort(dim=-1).values
    weights = scores.gather(1, experts)
    if spec.norm_topk_prob and spec.num_experts_per_tok > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + _NORM_EPS)
    return Routing(experts, weights * spec.routed_scaling_factor)


def sort_by_expert(routing: Routing, n_experts: int) -> tuple[Tensor, Tensor]:
    """(pair order, counts [E]): ``order`` lists the T·k token-expert pairs (flat index t·k + j)
    grouped by expert, ascending, token order kept inside a group. No host sync (a CUDA
    `bincount` reads its max on the host; a scatter-add does not)."""
    flat = routing.experts.flatten()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device)
    return order, counts.scatter_add_(0, flat, torch.ones_like(flat))
