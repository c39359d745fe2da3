"""MoE ops: routing rules, clamped SwiGLU, the grouped experts against per-token loops."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from dsv4cp.layers.moe import MoE
from dsv4cp.ops.linear import dequant_fp4, dequant_fp8_blocks
from dsv4cp.ops.moe import moe
from dsv4cp.ops.moe_experts import clamped_swiglu, expert_mlp, grouped_expert_mlp
from dsv4cp.ops.moe_routing import MoeSpec, gate_scores, route, sort_by_expert
from dsv4cp.ops.moe_weights import ExpertStack, QuantWeight
from dsv4cp.ops.quant import fp4_quant
from tests.model import dsv41_fixture as fx

E, K, D, INTER = 8, 2, 64, 96
SPEC = MoeSpec(
    n_routed_experts=E,
    num_experts_per_tok=K,
    routed_scaling_factor=1.5,
    swiglu_limit=10.0,
)


def _e8m0(pow2: Tensor) -> Tensor:
    return ((pow2.float().view(torch.int32) >> 23).to(torch.uint8)).view(torch.float8_e8m0fnu)


def _fp4_stack(n_out: int, n_in: int, gen: torch.Generator, std: float) -> ExpertStack:
    packed, scale = fp4_quant(torch.randn(E, n_out, n_in, generator=gen) * std)
    return ExpertStack(packed.view(torch.int8), _e8m0(scale))


def _fp8(n_out: int, n_in: int, gen: torch.Generator, std: float) -> QuantWeight:
    blocks = (-(-n_out // 32), -(-n_in // 32))
    exps = torch.randint(-2, 3, blocks, generator=gen)
    scale = torch.exp2(exps.float())
    per_elem = scale.repeat_interleave(32, 0)[:n_out].repeat_interleave(32, 1)[:, :n_in]
    codes = (torch.randn(n_out, n_in, generator=gen) * std / per_elem).to(torch.float8_e4m3fn)
    return QuantWeight(codes, _e8m0(scale))


def _weights(seed: int, std: float = 0.2):
    g = torch.Generator().manual_seed(seed)
    experts = (
        _fp4_stack(INTER, D, g, std),
        _fp4_stack(INTER, D, g, std),
        _fp4_stack(D, INTER, g, std),
    )
    shared = (_fp8(INTER, D, g, std), _fp8(INTER, D, g, std), _fp8(D, INTER, g, std))
    gate_w = (torch.randn(E, D, generator=g) * 0.3).bfloat16()
    gate_b = torch.randn(E, generator=g) * 0.1
    return gate_w, gate_b, experts, shared


def _moe(x: Tensor, weights: tuple, quant: str) -> Tensor:
    gate_w, gate_b, experts, shared = weights
    return moe(
        x,
        gate_weight=gate_w,
        gate_bias=gate_b,
        experts=experts,
        shared=shared,
        spec=SPEC,
        quant=quant,  # type: ignore[arg-type]
    )


def _x(n: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> Tensor:
    return (torch.randn(n, D, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _dense(w: QuantWeight | tuple[Tensor, Tensor]) -> Tensor:
    weight, scale = w
    if weight.dtype == torch.float8_e4m3fn:
        return dequant_fp8_blocks(weight, scale).double()
    return dequant_fp4(weight, scale).double()


def _naive_moe_fp64(x: Tensor, gate_w, gate_b, experts, shared, spec: MoeSpec) -> Tensor:
    """Token by token in fp64, written from the formulas (no dsv4cp routing code)."""
    limit = spec.swiglu_limit

    def mlp(v: Tensor, ws) -> Tensor:
        g, u = v @ _dense(ws[0]).t(), v @ _dense(ws[1]).t()
        return (F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)), _dense(ws[2])

    out = []
    for t in range(x.shape[0]):
        v = x[t].double()
        s = F.softplus(v @ gate_w.double().t()).sqrt()
        chosen = sorted(range(E), key=lambda e: (-(s[e] + gate_b[e]).item(), e))[
            : spec.num_experts_per_tok
        ]
        w = s[chosen] / (s[chosen].sum() + 1e-20) * spec.routed_scaling_factor
        y = torch.zeros(D, dtype=torch.float64)
        for e, we in zip(chosen, w):
            h, w2 = mlp(v, tuple(st.expert(e) for st in experts))
            y += w2 @ (we * h)
        h, w2 = mlp(v, shared)
        out.append(y + w2 @ h)
    return torch.stack(out)


def test_scoring_functions() -> None:
    x, w = _x(5, 1, torch.float32), torch.randn(E, D)
    logits = x @ w.t() / 2.0
    for name, want in (
        ("sqrtsoftplus", F.softplus(logits).sqrt()),
        ("sigmoid", logits.sigmoid()),
        ("softmax", logits.softmax(-1)),
    ):
        torch.testing.assert_close(gate_scores(x, w, scoring_func=name, gate_temp=2.0), want)


def test_bias_selects_but_does_not_weight() -> None:
    x = _x(6, 2, torch.bfloat16)
    gate_w = torch.randn(E, D).bfloat16()
    scores = gate_scores(x, gate_w, scoring_func="sqrtsoftplus", gate_temp=1.0)
    bias = torch.zeros(E)
    bias[5] = 100.0  # expert 5 always chosen, whatever its score
    got = route(x, gate_w, bias, SPEC)
    assert (got.experts == 5).any(dim=1).all()
    assert (got.experts[:, :-1] < got.experts[:, 1:]).all()  # ascending
    raw = scores.gather(1, got.experts)
    torch.testing.assert_close(got.weights, raw / raw.sum(1, keepdim=True) * 1.5)
    torch.testing.assert_close(got.weights.sum(1), torch.full((6,), 1.5))


def test_all_experts_tied_go_to_the_lowest_indices() -> None:
    x = _x(3, 3, torch.float32)
    got = route(x, torch.zeros(E, D), torch.zeros(E), SPEC)
    assert got.experts.tolist() == [[0, 1]] * 3
    torch.testing.assert_close(got.weights, torch.full((3, K), 0.75))


def test_single_expert_weight_is_not_normalised() -> None:
    spec = MoeSpec(n_routed_experts=E, num_experts_per_tok=1, routed_scaling_factor=2.0)
    x, gate_w = _x(4, 4, torch.float32), torch.randn(E, D)
    got = route(x, gate_w, None, spec)
    scores = gate_scores(x, gate_w, scoring_func="sqrtsoftplus", gate_temp=1.0)
    assert torch.equal(got.experts[:, 0], scores.argmax(1))
    torch.testing.assert_close(got.weights[:, 0], scores.amax(1) * 2.0)


def test_swiglu_clamps_up_both_ways_and_gate_from_above() -> None:
    gate = torch.tensor([-30.0, 5.0, 30.0, 30.0])
    up = torch.tensor([-30.0, 30.0, 2.0, -30.0])
    got = clamped_swiglu(gate, up, 10.0)
    want = F.silu(torch.tensor([-30.0, 5.0, 10.0, 10.0])) * torch.tensor([-10.0, 10.0, 2.0, -10.0])
    assert torch.equal(got, want)
    assert torch.equal(clamped_swiglu(gate, up, 0.0), F.silu(gate) * up)


@pytest.mark.parametrize("n", [1, 7, 40])
def test_moe_exact_math_matches_fp64(n: int) -> None:
    gate_w, gate_b, experts, shared = _weights(5)
    x = _x(n, 6, torch.float32, scale=3.0)  # large enough for the swiglu clamp to act
    got = _moe(x, (gate_w, gate_b, experts, shared), "none")
    want = _naive_moe_fp64(x, gate_w, gate_b, experts, shared, SPEC)
    # fp32 against fp64: errors scale with the largest value (outputs reach ~200 here)
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err <= 2e-6, f"max error {err:.3g} of the largest output"


def test_clamp_is_active_in_the_fp64_check() -> None:
    gate_w, gate_b, experts, shared = _weights(5)
    x = _x(40, 6, torch.float32, scale=3.0)
    h = x @ dequant_fp4(*experts[0].expert(0)).t()
    assert (h > SPEC.swiglu_limit).any()


def _per_token_qat(x: Tensor, gate_w, gate_b, experts, shared) -> Tensor:
    """The reference's order: per token, fp32 y = Σ experts ascending + shared, then x.dtype."""
    routing = route(x, gate_w, gate_b, SPEC)
    out = []
    for t in range(x.shape[0]):
        y = torch.zeros(1, D)
        for j, e in enumerate(routing.experts[t].tolist()):
            ws = tuple(st.expert(e) for st in experts)
            y = (
                y
                + expert_mlp(
                    x[t : t + 1],
                    *ws,
                    swiglu_limit=10.0,
                    quant="qat",
                    route_weight=routing.weights[t, j : j + 1],
                ).float()
            )
        y = y + expert_mlp(x[t : t + 1], *shared, swiglu_limit=10.0, quant="qat").float()
        out.append(y.to(x.dtype))
    return torch.cat(out)


def test_grouped_qat_equals_the_per_token_loop_bitwise() -> None:
    gate_w, gate_b, experts, shared = _weights(7)
    x = _x(23, 8, torch.bfloat16, scale=2.0)
    got = _moe(x, (gate_w, gate_b, experts, shared), "qat")
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, _per_token_qat(x, gate_w, gate_b, experts, shared))


def test_sort_by_expert_groups_pairs() -> None:
    routing = route(_x(9, 9, torch.float32), torch.randn(E, D), None, SPEC)
    order, counts = sort_by_expert(routing, E)
    flat = routing.experts.flatten()[order]
    assert torch.equal(flat, flat.sort().values)
    assert torch.equal(counts, torch.bincount(routing.experts.flatten(), minlength=E))
    for e in range(E):  # token order kept inside a group
        tokens = (order[flat == e] // K).tolist()
        assert tokens == sorted(tokens)


def _pairs(n: int, seed: int, dtype: torch.dtype):
    gate_w, gate_b, experts, _ = _weights(seed)
    x = _x(n, seed + 1, dtype, scale=2.0)
    routing = route(x, gate_w, gate_b, SPEC)
    order, counts = sort_by_expert(routing, E)
    return x[order // K], counts, experts, routing.weights.flatten()[order]


def test_grouped_mm_backend_matches_loop_exact_math() -> None:
    xs, counts, experts, rw = _pairs(30, 10, torch.float32)
    kw = {"route_weight": rw, "swiglu_limit": 10.0, "quant": "none"}
    loop = grouped_expert_mlp(xs, counts, *experts, backend="loop", **kw)
    grouped = grouped_expert_mlp(xs, counts, *experts, backend="grouped_mm", **kw)
    chunked = grouped_expert_mlp(xs, counts, *experts, backend="grouped_mm", expert_chunk=3, **kw)
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked, grouped, rtol=1e-6, atol=1e-6)


def test_grouped_mm_backend_matches_loop_qat_bf16() -> None:
    """Same fp8 activations and exact products; only fp32 summation order differs, which can
    move a bf16 output by an ulp or an fp8 code of the W2 input by one step."""
    xs, counts, experts, rw = _pairs(64, 11, torch.bfloat16)
    kw = {"route_weight": rw, "swiglu_limit": 10.0, "quant": "qat"}
    loop = grouped_expert_mlp(xs, counts, *experts, backend="loop", **kw).float()
    grouped = grouped_expert_mlp(xs, counts, *experts, backend="grouped_mm", **kw).float()
    within_ulp = ((grouped - loop).abs() <= fx.ulp_bf16(loop)).float().mean().item()
    rms_rel = ((grouped - loop).norm() / loop.norm()).item()
    assert within_ulp >= 0.99 and rms_rel <= 1e-3, (within_ulp, rms_rel)


def test_moe_rows_are_independent() -> None:
    """CP shards rows: each token's output depends on that token only (up to an fp32 GEMM's
    row-count-dependent rounding in the gate, which may move a bf16 output by one ulp)."""
    weights = _weights(12)
    x = _x(17, 13, torch.bfloat16, scale=2.0)
    whole = _moe(x, weights, "qat").float()
    parts = torch.cat([_moe(x[a:b], weights, "qat") for a, b in ((0, 1), (1, 9), (9, 17))])
    parts = parts.float()
    assert ((parts - whole).abs() <= fx.ulp_bf16(whole)).all()


def test_bad_arguments_are_value_errors() -> None:
    with pytest.raises(ValueError, match="scoring_func"):
        MoeSpec(n_routed_experts=E, num_experts_per_tok=K, scoring_func="relu")
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoeSpec(n_routed_experts=E, num_experts_per_tok=E + 1)
    cfg = SimpleNamespace(**{**vars(fx.text_config()), "n_shared_experts": 2})
    with pytest.raises(ValueError, match="n_shared_experts"):
        MoeSpec.from_config(cfg)
    xs, counts, experts, rw = _pairs(4, 14, torch.float32)
    with pytest.raises(ValueError, match="backend"):
        grouped_expert_mlp(
            xs, counts, *experts, route_weight=rw, swiglu_limit=0.0, quant="none", backend="cuda"
        )
    with pytest.raises(ValueError, match="w2"):
        grouped_expert_mlp(
            xs,
            counts,
            experts[0],
            experts[1],
            experts[0],
            route_weight=rw,
            swiglu_limit=0.0,
            quant="none",
        )
    with pytest.raises(ValueError, match="gate weight"):
        route(xs, torch.zeros(E + 1, D), None, SPEC)


def test_layer_slots_are_the_checkpoint_names() -> None:
    layer = MoE(fx.text_config(), dtype=torch.bfloat16, device="cpu")
    slots = layer.checkpoint_slots("layers.2.ffn.")
    in_ckpt = {n for n in fx.names() if n.startswith("layers.2.ffn.")}
    assert set(slots) == in_ckpt - {"layers.2.ffn.gate.bias_vl"}
    fx.load_slots(slots)  # dtypes and shapes as stored
    assert torch.equal(layer.w2_weight[3], fx.tensor("layers.2.ffn.experts.3.w2.weight"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("chunk", [32, 3])
def test_grouped_mm_on_cuda_matches_the_cpu_loop(chunk: int) -> None:
    xs, counts, experts, rw = _pairs(300, 15, torch.bfloat16)
    kw = {"swiglu_limit": 10.0, "quant": "qat"}
    loop = grouped_expert_mlp(xs, counts, *experts, route_weight=rw, backend="loop", **kw).float()
    on_gpu = [ExpertStack(w.cuda(), s.cuda()) for w, s in experts]
    got = grouped_expert_mlp(
        xs.cuda(), counts.cuda(), *on_gpu, route_weight=rw.cuda(), expert_chunk=chunk, **kw
    )
    got = got.float().cpu()
    within_ulp = ((got - loop).abs() <= fx.ulp_bf16(loop)).float().mean().item()
    rms_rel = ((got - loop).norm() / loop.norm()).item()
    assert within_ulp >= 0.99 and rms_rel <= 1e-3, (within_ulp, rms_rel)
