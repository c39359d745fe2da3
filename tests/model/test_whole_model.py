"""The tiny config with the whole V4.1 block (`tiny_full`: mHC + MoE around the attention), random
weights, fp32 `none`: CP = 2, 3, 4 against one-shot CP = 1 (chunked prefill, mixed batches and
decode: tests/model/test_chunked.py); the quant mode is checked at construction; random weights
in every storage.

Tolerance 1e-5 relative (fp32): the attention, the hyper-connections and the MoE gate are
bit-exact under CP (the row-local fp32 mixes run row by row: ops/rowwise.py), but in `none` the
experts' fp32 GEMMs (the dequantized weights, plain GEMMs) sum in an order that depends on how
many rows an expert gets (CPU GEMM kernels are chosen by M): measured ≤ 9e-6 absolute on values
of order 1 (docs/model.md). No expert choice or top-k entry flips in these cases. (`qat` is
bit-exact: tests/model/test_whole_model_qat.py.)
"""

from __future__ import annotations

import pytest
import torch

from dsv4cp.config import DeepseekV41Config
from dsv4cp.layers.block import DenseFFN
from dsv4cp.layers.moe import MoE
from dsv4cp.model import DeepseekV41Model
from dsv4cp.ops.linear import dequant_fp4, dequant_fp8_blocks
from dsv4cp.tools.checking import Scenario, compare, run_cp_scenario, run_scenario

TOL = 1e-5


@pytest.fixture(scope="module")
def model() -> DeepseekV41Model:
    return DeepseekV41Model(DeepseekV41Config.tiny_full(), seed=2)


def test_blocks_hold_the_configured_parts(model: DeepseekV41Model) -> None:
    for block in model.blocks:
        assert isinstance(block.ffn, MoE) and block.hc_attn is not None
        assert block.engram is None
    dense = DeepseekV41Model(DeepseekV41Config.tiny(), seed=None)
    assert all(isinstance(b.ffn, DenseFFN) and b.hc_attn is None for b in dense.blocks)


def test_quant_modes_are_checked_at_construction() -> None:
    with pytest.raises(NotImplementedError, match="no quantization_config"):
        DeepseekV41Model(DeepseekV41Config.tiny_full(), seed=None, quant="qat")
    quantized = DeepseekV41Config.tiny(quantization=DeepseekV41Config.flash().quantization)
    with pytest.raises(NotImplementedError, match="dense SwiGLU"):
        DeepseekV41Model(quantized, seed=None, quant="qat")
    with pytest.raises(ValueError, match="unknown quant mode"):
        DeepseekV41Model(DeepseekV41Config.tiny_full(), seed=None, quant="fp8")


def test_random_weights_in_every_storage(model: DeepseekV41Model) -> None:
    """Quantized weights hold N(0, 1/fan_in) values quantized; same seed, same weights."""
    moe = model.blocks[0].ffn
    assert isinstance(moe, MoE)
    w1 = moe.stack("w1")
    experts = dequant_fp4(w1.weight[0], w1.scale[0])
    fan_in = experts.shape[1]
    assert abs(experts.std().item() * fan_in**0.5 - 1) < 0.15
    shared = moe.shared["w1"]
    assert shared.scale is not None
    dense = dequant_fp8_blocks(shared.weight, shared.scale)
    assert abs(dense.std().item() * fan_in**0.5 - 1) < 0.15
    again = DeepseekV41Model(DeepseekV41Config.tiny_full(), seed=2)
    for name, t in model.checkpoint_weights().items():
        assert torch.equal(t.view(torch.uint8), again.checkpoint_weights()[name].view(torch.uint8))


@pytest.fixture(scope="module")
def scenario_cp1() -> tuple[Scenario, dict[str, torch.Tensor]]:
    sc = Scenario(lens=(7, 130), prefix=(0, 5), chunk=64, seed=3)
    return sc, run_scenario(sc)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_cp_equals_cp1(scenario_cp1, cp: int) -> None:
    """Logits, every block's streams, the last top-k per ratio and every cache row."""
    sc, ref = scenario_cp1
    got, _ = run_cp_scenario(sc, cp, "fake")
    cmp = compare(ref, got)
    assert not cmp.keys_missing and all(cmp.topk_equal.values())
    assert any(k.startswith("hidden/layer") for k in cmp.max_rel)
    worst = max(cmp.max_rel.items(), key=lambda kv: kv[1])
    assert worst[1] <= TOL, worst


@pytest.mark.slow
def test_cp2_gloo_equals_cp1(scenario_cp1) -> None:
    sc, ref = scenario_cp1
    got, _ = run_cp_scenario(sc, 2, "gloo", timeout_s=120)
    assert compare(ref, got).passed(TOL)


def test_set_quant_switches_every_part_and_is_checked() -> None:
    quantized = DeepseekV41Config.tiny_full(quantization=DeepseekV41Config.flash().quantization)
    model = DeepseekV41Model(quantized, seed=0, dtype=torch.bfloat16)
    assert model.quant == "none"
    model.set_quant("qat")
    assert all(b.quant == "qat" and b.attn.quant == "qat" for b in model.blocks)
    with pytest.raises(NotImplementedError, match="no quantization_config"):
        DeepseekV41Model(DeepseekV41Config.tiny_full(), seed=None).set_quant("qat")


@pytest.mark.parametrize("quant", ["none", "qat"])
def test_moe_shared_expert_through_its_linears_equals_the_twin(model, quant: str) -> None:
    from dsv4cp.ops.moe_experts import expert_mlp

    moe = model.blocks[1].ffn
    assert isinstance(moe, MoE)
    x = torch.randn(37, 128, generator=torch.Generator().manual_seed(5))
    twin = expert_mlp(
        x, *(moe._shared(n) for n in ("w1", "w3", "w2")), swiglu_limit=10.0, quant=quant
    )
    assert torch.equal(moe.shared_mlp(x, quant), twin)


@pytest.mark.parametrize("quant", ["none", "qat"])
def test_masked_experts_equal_the_loop(model, quant: str) -> None:
    """The capture-safe backend (no host sync) computes what the loop does: bit for bit in qat
    (exact fp8/fp4 block partials), up to fp32 summation order in none."""
    moe = model.blocks[2].ffn
    assert isinstance(moe, MoE)
    x = torch.randn(45, 128, generator=torch.Generator().manual_seed(9))
    loop = moe(x, quant=quant, backend="loop")
    masked = moe(x, quant=quant, backend="masked")
    if quant == "qat":
        assert torch.equal(masked, loop)
    else:
        assert (masked - loop).abs().max() <= 1e-5 * loop.abs().max()
