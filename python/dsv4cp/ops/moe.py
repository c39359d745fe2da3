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
reuses `combine`, and its twins below (`ep_dispatch`, `ep_pack`, `ep_local_experts`,
`ep_per_token`) give every expert the rows, in the order, that it gets here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from dsv4cp.ops.linear import dequant_fp4, linear
from dsv4cp.ops.quant import QuantMode, check_quant_mode, fake_act_quant_fp8
from dsv4cp.ops.rowwise import rowwise_linear_fp32

ScoringFunc = Literal["sqrtsoftplus", "sigmoid", "softmax"]
GroupedBackend = Literal["auto", "loop", "grouped_mm", "masked"]
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


class Routing(NamedTuple):
    """Per token: the chosen experts (int64 [T, k], ascending) and their weights (fp32 [T, k])."""

    experts: Tensor
    weights: Tensor


def gate_scores(x: Tensor, gate_weight: Tensor, *, scoring_func: str, gate_temp: float) -> Tensor:
    """fp32 [T, E] affinities of each token for each routed expert."""
    logits = rowwise_linear_fp32(x, gate_weight) / gate_temp  # row-local bit for bit
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    if scoring_func == "softmax":
        return logits.softmax(dim=-1)
    raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {scoring_func!r}")


def route(x: Tensor, gate_weight: Tensor, gate_bias: Tensor | None, spec: MoeSpec) -> Routing:
    """Pick ``top_k`` experts per token by scores + bias; weight them by the unbiased scores."""
    if gate_weight.shape != (spec.n_routed_experts, x.shape[-1]):
        raise ValueError(
            f"route: gate weight must be [{spec.n_routed_experts}, {x.shape[-1]}], "
            f"got {tuple(gate_weight.shape)}"
        )
    scores = gate_scores(x, gate_weight, scoring_func=spec.scoring_func, gate_temp=spec.gate_temp)
    select = scores if gate_bias is None else scores + gate_bias.float()
    order = torch.sort(select, dim=-1, descending=True, stable=True).indices
    experts = order[:, : spec.num_experts_per_tok].sort(dim=-1).values
    weights = scores.gather(1, experts)
    if spec.norm_topk_prob and spec.num_experts_per_tok > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + _NORM_EPS)
    return Routing(experts, weights * spec.routed_scaling_factor)


def clamped_swiglu(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    """silu(min(gate, L)) · clamp(up, -L, L) in fp32; no clamp when L = 0."""
    g, u = gate.float(), up.float()
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    return F.silu(g) * u


def expert_mlp(
    x: Tensor,
    w1: QuantWeight,
    w3: QuantWeight,
    w2: QuantWeight,
    *,
    swiglu_limit: float,
    quant: QuantMode,
    route_weight: Tensor | None = None,
) -> Tensor:
    """One SwiGLU expert on x [N, d] → x.dtype [N, d]; route_weight [N] multiplies before W2."""
    h = clamped_swiglu(linear(x, *w1, quant), linear(x, *w3, quant), swiglu_limit)
    if route_weight is not None:
        h = route_weight.float().unsqueeze(-1) * h
    return linear(h.to(x.dtype), *w2, quant)


def _stack_shape(name: str, stack: ExpertStack, n_experts: int) -> tuple[int, int]:
    w, s = stack
    if w.dim() != 3 or w.shape[0] != n_experts or s.dim() != 3 or s.shape[:2] != w.shape[:2]:
        raise ValueError(
            f"{name}: expected packed fp4 [{n_experts}, out, in/2] with scales [{n_experts}, out, "
            f"in/32], got {tuple(w.shape)} and {tuple(s.shape)}"
        )
    return w.shape[1], w.shape[2] * 2


def _grouped_projection(
    x: Tensor,
    stack: ExpertStack,
    ends: list[int] | None,
    counts: Tensor,
    quant: QuantMode,
    expert_chunk: int,
) -> Tensor:
    """x [P, K] sorted by expert → [P, N]: one ``torch._grouped_mm`` per chunk of experts over
    their weights dequantized to x.dtype (exact: e2m1·2^k and e4m3·2^k fit bf16)."""
    n_experts, n_out, k_half = stack.weight.shape
    xq = fake_act_quant_fp8(x) if quant == "qat" else x
    out = x.new_empty(x.shape[0], n_out)
    for e0 in range(0, n_experts, expert_chunk):
        e1 = min(n_experts, e0 + expert_chunk)
        start = 0 if e0 == 0 else ends[e0 - 1]  # type: ignore[index]
        stop = x.shape[0] if e1 == n_experts else ends[e1 - 1]  # type: ignore[index]
        w = (
            dequant_fp4(stack.weight[e0:e1].reshape(-1, k_half), stack.scale[e0:e1].flatten(0, 1))
            .view(e1 - e0, n_out, 2 * k_half)
            .to(x.dtype)
        )
        offs = counts[e0:e1].cumsum(0).to(torch.int32)
        out[start:stop] = torch._grouped_mm(xq[start:stop], w.transpose(-2, -1), offs=offs)
    return out


def grouped_expert_mlp(
    x_sorted: Tensor,
    counts: Tensor,
    w1: ExpertStack,
    w3: ExpertStack,
    w2: ExpertStack,
    *,
    route_weight: Tensor,
    swiglu_limit: float,
    quant: QuantMode,
    backend: GroupedBackend = "auto",
    expert_chunk: int = 32,
) -> Tensor:
    """Routed experts over token rows already sorted by expert: rows [offs[e-1], offs[e]) of
    x_sorted [P, d] go to expert e, where offs = cumsum(counts [E]). Returns x.dtype [P, d].

    ``"loop"`` (the torch twin, the reference numerics): one ``expert_mlp`` per non-empty expert
    on its contiguous slice. ``"grouped_mm"``: three ``torch._grouped_mm`` launches per chunk of
    ``expert_chunk`` experts, the fp4 weights dequantized chunk by chunk; it differs from the loop
    only in the fp32 summation order inside a GEMM. ``"masked"``: every expert on every row,
    kept where the row is the expert's — no host sync, for CUDA graph capture of small models
    (E times the work). ``"auto"``: grouped_mm for CUDA bf16, masked while a CUDA stream is
    capturing, else loop.
    """
    quant = check_quant_mode(quant)
    n_experts = counts.shape[0]
    inter, dim = _stack_shape("w1", w1, n_experts)
    if _stack_shape("w3", w3, n_experts) != (inter, dim):
        raise ValueError(f"w3 must match w1 [{n_experts}, {inter}, {dim // 2}]")
    if _stack_shape("w2", w2, n_experts) != (dim, inter):
        raise ValueError(f"w2 must be [{n_experts}, {dim}, {inter // 2}] packed")
    if x_sorted.dim() != 2 or x_sorted.shape[1] != dim:
        raise ValueError(f"x_sorted must be [P, {dim}], got {tuple(x_sorted.shape)}")
    if route_weight.shape != x_sorted.shape[:1]:
        raise ValueError(
            f"route_weight must be [{x_sorted.shape[0]}], got {tuple(route_weight.shape)}"
        )
    if backend == "auto":
        if x_sorted.is_cuda and x_sorted.dtype == torch.bfloat16:
            backend = "grouped_mm"
        elif x_sorted.is_cuda and torch.cuda.is_current_stream_capturing():
            backend = "masked"
        else:
            backend = "loop"
    if backend == "masked":
        return _masked_experts(x_sorted, counts, w1, w3, w2, route_weight, swiglu_limit, quant)
    if backend == "grouped_mm":
        # chunk boundaries need host offsets; a single chunk needs none (no device sync)
        ends = None if expert_chunk >= n_experts else counts.cumsum(0).tolist()
        h1 = _grouped_projection(x_sorted, w1, ends, counts, quant, expert_chunk)
        h3 = _grouped_projection(x_sorted, w3, ends, counts, quant, expert_chunk)
        h = route_weight.float().unsqueeze(-1) * clamped_swiglu(h1, h3, swiglu_limit)
        return _grouped_projection(h.to(x_sorted.dtype), w2, ends, counts, quant, expert_chunk)
    if backend != "loop":
        raise ValueError(
            f"backend must be 'auto', 'loop', 'grouped_mm' or 'masked', got {backend!r}"
        )
    out = x_sorted.new_empty(x_sorted.shape)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            rows = slice(start, start + n)
            out[rows] = expert_mlp(
                x_sorted[rows],
                w1.expert(e),
                w3.expert(e),
                w2.expert(e),
                swiglu_limit=swiglu_limit,
                quant=quant,
                route_weight=route_weight[rows],
            )
        start += n
    return out


def _masked_experts(
    x_sorted: Tensor,
    counts: Tensor,
    w1: ExpertStack,
    w3: ExpertStack,
    w2: ExpertStack,
    route_weight: Tensor,
    swiglu_limit: float,
    quant: QuantMode,
) -> Tensor:
    n_experts, p = counts.shape[0], x_sorted.shape[0]
    experts = torch.arange(n_experts, device=counts.device)
    owner = torch.repeat_interleave(experts, counts, output_size=p)  # no host sync
    out = x_sorted.new_zeros(x_sorted.shape)
    for e in range(n_experts):
        y = expert_mlp(
            x_sorted,
            w1.expert(e),
            w3.expert(e),
            w2.expert(e),
            swiglu_limit=swiglu_limit,
            quant=quant,
            route_weight=route_weight,
        )
        out = torch.where((owner == e)[:, None], y, out)
    return out


def sort_by_expert(routing: Routing, n_experts: int) -> tuple[Tensor, Tensor]:
    """(pair order, counts [E]): ``order`` lists the T·k token-expert pairs (flat index t·k + j)
    grouped by expert, ascending, token order kept inside a group. No host sync (a CUDA
    `bincount` reads its max on the host; a scatter-add does not)."""
    flat = routing.experts.flatten()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device)
    return order, counts.scatter_add_(0, flat, torch.ones_like(flat))


def routed_per_token(
    x: Tensor,
    routing: Routing,
    experts: tuple[ExpertStack, ExpertStack, ExpertStack],
    spec: MoeSpec,
    quant: QuantMode,
    backend: GroupedBackend = "auto",
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
) -> Tensor:
    """The whole MoE on x [T, d] (the ffn_norm output) → x.dtype [T, d]. ``experts``/``shared``
    are the (w1, w3, w2) projections: w1 gate, w3 up, w2 down. ``shared_mlp``, when given,
    computes the shared expert instead of ``expert_mlp`` on ``shared`` (the layer's routed fp8
    kernels on CUDA; the same math)."""
    if x.dim() != 2:
        raise ValueError(f"moe: x must be [T, d], got {tuple(x.shape)}")
    routing = route(x, gate_weight, gate_bias, spec)
    per_token = routed_per_token(x, routing, experts, spec, quant, backend)
    if shared_mlp is None:
        shared_out = expert_mlp(x, *shared, swiglu_limit=spec.swiglu_limit, quant=quant)
    else:
        shared_out = shared_mlp(x)
    return combine(per_token, shared_out, x.dtype)


# --- expert parallelism: the tensor work around the exchanges (layers/moe.py runs them) ------


class Dispatch(NamedTuple):
    """An EP dispatch of one rank: ``order`` every flat pair id (t·k + j) grouped by destination
    rank (token order kept inside a group; pairs of padding rows last, not sent) and ``counts``
    int64 [ranks]: pairs for each destination."""

    order: Tensor
    counts: Tensor


META_BYTES = 12  # per pair: local expert (int32), routing weight (fp32 bits), global token (int32)


def pack_pairs(x_rows: Tensor, local_expert: Tensor, weight: Tensor, token: Tensor) -> Tensor:
    """One uint8 row per pair: the token's row of x (its dtype's bytes), then META_BYTES of
    (local expert int32, routing weight fp32, global token id int32). One all_to_all moves it."""
    meta = torch.stack(
        [local_expert.to(torch.int32), weight.float().view(torch.int32), token.to(torch.int32)],
        dim=1,
    )
    return torch.cat([x_rows.contiguous().view(torch.uint8), meta.view(torch.uint8)], dim=1)


def unpack_pairs(
    rows: Tensor, dtype: torch.dtype, dim: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`pack_pairs` inverted: (x rows [n, dim] dtype, local expert int64, weight fp32, token
    int64)."""
    width = dim * torch.empty((), dtype=dtype).element_size()
    if rows.dim() != 2 or rows.shape[1] != width + META_BYTES:
        raise ValueError(f"unpack_pairs: rows must be [n, {width + META_BYTES}] uint8")
    x = rows[:, :width].contiguous().view(dtype)
    meta = rows[:, width:].contiguous().view(torch.int32)
    return x, meta[:, 0].long(), meta[:, 1].view(torch.float32), meta[:, 2].long()


def _token_ids(routing: Routing, row_ids: Tensor | None) -> Tensor:
    t = routing.experts.shape[0]
    return torch.arange(t, device=routing.experts.device) if row_ids is None else row_ids


def ep_dispatch(
    routing: Routing, row_ids: Tensor | None, n_ranks: int, experts_per_rank: int
) -> Dispatch:
    """Where the pairs of this rank's rows go, for expert parallelism over `n_ranks` ranks each
    holding `experts_per_rank` consecutive experts. Rows with `row_ids` < 0 (CP padding) send
    nothing. No host sync."""
    k = routing.experts.shape[1]
    flat = routing.experts.flatten()
    valid = (_token_ids(routing, row_ids) >= 0).repeat_interleave(k)
    dest = torch.where(valid, flat // experts_per_rank, n_ranks)  # n_ranks: not sent
    order = torch.sort(dest, stable=True).indices
    counts = torch.zeros(n_ranks + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, dest, torch.ones_like(dest))
    return Dispatch(order, counts[:n_ranks])


def ep_pack(
    x: Tensor,
    routing: Routing,
    row_ids: Tensor | None,
    pairs: Tensor,
    experts_per_rank: int,
) -> Tensor:
    """The `pack_pairs` rows of `pairs` (the first Σ counts of `Dispatch.order`): x's row, the
    expert's number on its rank, the routing weight and the global token id (`row_ids`, default
    the row index), which owners order their rows by, as expert parallelism 1 does."""
    k = routing.experts.shape[1]
    return pack_pairs(
        x[pairs // k],
        routing.experts.flatten()[pairs] % experts_per_rank,
        routing.weights.flatten()[pairs],
        _token_ids(routing, row_ids).repeat_interleave(k)[pairs],
    )


def ep_local_experts(
    rows: Tensor,
    dtype: torch.dtype,
    experts: tuple[ExpertStack, ExpertStack, ExpertStack],
    spec: MoeSpec,
    quant: QuantMode,
    backend: GroupedBackend = "auto",
) -> Tensor:
    """The received pairs (`pack_pairs` rows, grouped by source rank) through this rank's
    experts → outputs x.dtype [n, d] in the received order. Each expert's rows are ordered by
    global token id, as with every expert on one rank, so each expert's GEMMs see the rows
    that expert parallelism 1 gives it, in the same order."""
    n_local = experts[0].weight.shape[0]
    dim = experts[0].weight.shape[2] * 2
    x, local, weight, token = unpack_pairs(rows, dtype, dim)
    order = torch.sort(local * (1 << 32) + token, stable=True).indices
    counts = torch.zeros(n_local, dtype=torch.int64, device=rows.device)
    counts.scatter_add_(0, local, torch.ones_like(local))
    out_sorted = grouped_expert_mlp(
        x[order],
        counts,
        *experts,
        route_weight=weight[order],
        swiglu_limit=spec.swiglu_limit,
        quant=quant,
        backend=backend,
    )
    out = torch.empty_like(out_sorted)
    out[order] = out_sorted
    return out


def ep_per_token(pair_out: Tensor, pairs: Tensor, t: int, k: int) -> Tensor:
    """The combined-back pair outputs [n, d] (in dispatch order) → [T, k, d]; pairs not sent
    (padding rows) are zero."""
    per_token = pair_out.new_zeros(t * k, pair_out.shape[-1])
    per_token[pairs] = pair_out
    return per_token.view(t, k, -1)
