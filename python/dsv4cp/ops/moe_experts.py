"""The routed experts' GEMMs: one clamped-SwiGLU expert (``Expert.forward`` of the DeepSeek
reference) and every expert over token rows grouped by expert, through a per-expert loop (the
reference numerics), ``torch._grouped_mm`` over chunks of experts, or a masked pass for CUDA
graph capture. Every GEMM goes through ``dsv4cp.ops.linear.linear``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from dsv4cp.ops.linear import dequant_fp4, linear
from dsv4cp.ops.matmul import linear_rows
from dsv4cp.ops.moe_weights import ExpertStack, QuantWeight, stack_shape
from dsv4cp.ops.quant import QuantMode, check_quant_mode, fake_act_quant_fp8
from dsv4cp.ops.rowwise import rowwise_linear_fp32

GroupedBackend = Literal["auto", "loop", "grouped_mm", "fused", "masked"]


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


def check_grouped_fp4_args(xq: Tensor, counts: Tensor, stack: ExpertStack) -> tuple[int, int]:
    """grouped_fp4_mm's shapes (the op and its kernel twin); returns the stack's (N, K)."""
    if counts.dim() != 1 or counts.is_floating_point():
        raise ValueError(f"grouped_fp4_mm: counts must be integer [E], got {counts.dtype}")
    n_out, k = stack_shape("grouped_fp4_mm stack", stack, counts.shape[0])
    if xq.dim() != 2 or xq.shape[1] != k:
        raise ValueError(f"grouped_fp4_mm: xq must be [P, {k}], got {tuple(xq.shape)}")
    return n_out, k


def grouped_fp4_mm(xq: Tensor, counts: Tensor, stack: ExpertStack) -> Tensor:
    """xq [P, K] sorted by expert (rows [offs[e-1], offs[e]) go to expert e, offs = cumsum(counts
    [E])) times each expert's fp4 weight [N, K] → [P, N] in xq.dtype: the weight dequantized
    exactly, exact products summed in fp32, one rounding (the kernel's numerics; its twin)."""
    n_out, _ = check_grouped_fp4_args(xq, counts, stack)
    out = xq.new_empty(xq.shape[0], n_out)
    if counts.sum().item() != xq.shape[0]:
        raise ValueError(f"grouped_fp4_mm: counts sum to {int(counts.sum())}, xq has {len(xq)}")
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            w = dequant_fp4(stack.weight[e], stack.scale[e], out_dtype=torch.float32)
            out[start : start + n] = linear_rows(xq[start : start + n].float(), w).to(xq.dtype)
        start += n
    return out


class ExpertKernels(NamedTuple):
    """The MoE's kernel-routed steps: the ops twins by default; the layer passes the routed
    kernels (`routing.dequant_fp4`, `routing.fake_act_quant_fp8`, `routing.rowwise_linear_fp32`;
    ops do not import routing). The first two are bit for bit their twins; the gate's GEMM is
    row-local either way and agrees with its twin to the fp32 order bound."""

    # (packed [N, K/2], scale [N, K/32], *, out_dtype) → [N, K]
    dequant_fp4: Callable[..., Tensor] = dequant_fp4
    # x [P, K] → act_quant_fp8's codes × scales in x.dtype (qat only)
    fake_act_quant_fp8: Callable[[Tensor], Tensor] = fake_act_quant_fp8
    # the gate's fp32 GEMM: x [T, d], w [E, d] → [T, E], each row independent of the others
    gate_linear: Callable[[Tensor, Tensor], Tensor] = rowwise_linear_fp32
    # backend "fused": one projection of every expert in one call, (xq, counts, stack) → [P, N]
    grouped_fp4_mm: Callable[[Tensor, Tensor, ExpertStack], Tensor] = grouped_fp4_mm


TORCH_EXPERT_KERNELS = ExpertKernels()


def _grouped_projection(
    xq: Tensor,
    stack: ExpertStack,
    ends: list[int] | None,
    counts: Tensor,
    expert_chunk: int,
    dequant: Callable[..., Tensor],
) -> Tensor:
    """xq [P, K] (already fake-quantized in qat) sorted by expert → [P, N]: one
    ``torch._grouped_mm`` per chunk of experts over their weights dequantized to xq.dtype by
    ``dequant`` (exact: e2m1·2^k and e4m3·2^k fit bf16)."""
    n_experts, n_out, k_half = stack.weight.shape
    out = xq.new_empty(xq.shape[0], n_out)
    for e0 in range(0, n_experts, expert_chunk):
        e1 = min(n_experts, e0 + expert_chunk)
        start = 0 if e0 == 0 else ends[e0 - 1]  # type: ignore[index]
        stop = xq.shape[0] if e1 == n_experts else ends[e1 - 1]  # type: ignore[index]
        packed, scale = stack.weight[e0:e1].reshape(-1, k_half), stack.scale[e0:e1].flatten(0, 1)
        w = dequant(packed, scale, out_dtype=xq.dtype).view(e1 - e0, n_out, 2 * k_half)
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
    kernels: ExpertKernels = TORCH_EXPERT_KERNELS,
) -> Tensor:
    """Routed experts over token rows already sorted by expert: rows [offs[e-1], offs[e]) of
    x_sorted [P, d] go to expert e, where offs = cumsum(counts [E]). Returns x.dtype [P, d].

    ``"loop"`` (the torch twin, the reference numerics): one ``expert_mlp`` per non-empty expert
    on its contiguous slice. ``"grouped_mm"``: three ``torch._grouped_mm`` launches per chunk of
    ``expert_chunk`` experts, the fp4 weights dequantized chunk by chunk; it differs from the loop
    only in the fp32 summation order inside a GEMM. ``"fused"``: ``kernels.grouped_fp4_mm`` once
    per projection (no host sync; on the H200 6x slower than grouped_mm, so never "auto"'s
    choice: docs/model.md). ``"masked"``: every expert on every row,
    kept where the row is the expert's — no host sync, for CUDA graph capture of small models
    (E times the work). ``"auto"``: grouped_mm for CUDA bf16, masked while a CUDA stream is
    capturing, else loop.
    """
    quant = check_quant_mode(quant)
    n_experts = counts.shape[0]
    inter, dim = stack_shape("w1", w1, n_experts)
    if stack_shape("w3", w3, n_experts) != (inter, dim):
        raise ValueError(f"w3 must match w1 [{n_experts}, {inter}, {dim // 2}]")
    if stack_shape("w2", w2, n_experts) != (dim, inter):
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
    if backend in ("grouped_mm", "fused"):
        if backend == "fused":  # one call per projection, no host sync

            def project(v: Tensor, stack: ExpertStack) -> Tensor:
                return kernels.grouped_fp4_mm(v, counts, stack)

        else:
            # chunk boundaries need host offsets; a single chunk needs none (no device sync)
            ends = None if expert_chunk >= n_experts else counts.cumsum(0).tolist()
            chunking = (ends, counts, expert_chunk, kernels.dequant_fp4)

            def project(v: Tensor, stack: ExpertStack) -> Tensor:
                return _grouped_projection(v, stack, *chunking)

        def quantized(v: Tensor) -> Tensor:
            return kernels.fake_act_quant_fp8(v) if quant == "qat" else v

        xq = quantized(x_sorted)  # once for both w1 and w3
        h1, h3 = project(xq, w1), project(xq, w3)
        h = route_weight.float().unsqueeze(-1) * clamped_swiglu(h1, h3, swiglu_limit)
        return project(quantized(h.to(x_sorted.dtype)), w2)
    if backend != "loop":
        raise ValueError(
            f"backend must be 'auto', 'loop', 'grouped_mm', 'fused' or 'masked', got {backend!r}"
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
