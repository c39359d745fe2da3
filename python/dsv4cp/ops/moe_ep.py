"""Expert parallelism: the tensor work around the exchanges (`layers/moe.py` runs them,
docs/ep.md). `ep_dispatch`, `ep_pack`, `ep_local_experts` and `ep_per_token` give every expert the
rows, in the order, that it gets with all experts on one rank (`dsv4cp.ops.moe.moe`), so the
result is the same bit for bit."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from dsv4cp.ops.moe_experts import (
    TORCH_EXPERT_KERNELS,
    ExpertKernels,
    GroupedBackend,
    grouped_expert_mlp,
)
from dsv4cp.ops.moe_routing import MoeSpec, Routing
from dsv4cp.ops.moe_weights import ExpertStack
from dsv4cp.ops.quant import QuantMode


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
    kernels: ExpertKernels = TORCH_EXPERT_KERNELS,
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
        kernels=kernels,
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
