"""fp8 / fp4 linears and the qat index scores against DeepSeek's reference, and the checkpoint's
weights dequantized by hand.

Golden data: tests/fixtures/quant_golden.safetensors (quant_golden.README.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

from dsv4cp.layers.linear import Linear
from dsv4cp.ops.attention_quant import fake_quant_index_fp4, index_scores_qat
from dsv4cp.ops.indexer import indexer_weights, topk_indices
from dsv4cp.ops.linear import (
    dequant_fp4,
    dequant_fp8_blocks,
    dequant_fp8_rows,
    fp4_linear,
    fp8_linear,
    fp8_scale_shape,
    linear,
    quantize_fp8_blocks,
)
from dsv4cp.ops.quant import act_quant_fp8, e8m0_to_float, unpack_fp4

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GOLDEN = FIXTURES / "quant_golden.safetensors"
SHARD1 = FIXTURES / "dsv41-tiny-reference" / "checkpoint" / "model-00001-of-00003.safetensors"
U32 = 2.0**-24  # unit roundoff of fp32


@pytest.fixture(scope="module")
def golden() -> dict[str, torch.Tensor]:
    return load_file(GOLDEN)


def _gemm(golden: dict[str, torch.Tensor], tag: str, kind: str, dtype: torch.dtype) -> torch.Tensor:
    x, w = golden[f"gemm.{tag}.x"], golden[f"gemm.{tag}.{kind}"]
    scale = golden[f"gemm.{tag}.{kind}.scale"]
    if kind == "w8":
        return fp8_linear(x, w, scale, out_dtype=dtype)
    return fp4_linear(x, w, scale, out_dtype=dtype)


@pytest.mark.parametrize("kind", ["w8", "w4"])
def test_gemm_bit_exact_when_block_sums_are_exact(
    golden: dict[str, torch.Tensor], kind: str
) -> None:
    ref = "fp8" if kind == "w8" else "fp4"
    for dtype, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        assert torch.equal(_gemm(golden, "exact", kind, dtype), golden[f"gemm.exact.{ref}.{name}"])


@pytest.mark.parametrize("kind", ["w8", "w4"])
def test_gemm_random_within_the_block_rounding_bound(
    golden: dict[str, torch.Tensor], kind: str
) -> None:
    """Random codes: the reference's in-block fp32 matmul may round where our exact block sum does
    not, so fp32 outputs may differ by the dot-product error bound 2·(32 + K/32)·u·(|A|·|B|ᵀ); the
    bf16 outputs the model sees may differ by at most one bf16 ulp."""
    ref = "fp8" if kind == "w8" else "fp4"
    x, w = golden["gemm.random.x"], golden[f"gemm.random.{kind}"]
    scale = golden[f"gemm.random.{kind}.scale"]
    codes, a_scale = act_quant_fp8(x)
    a = (codes.float().unflatten(-1, (-1, 32)) * a_scale[..., None]).flatten(-2)
    b = dequant_fp8_blocks(w, scale) if kind == "w8" else dequant_fp4(w, scale)
    k = x.shape[-1]
    bound = 2 * (32 + k // 32) * U32 * (a.abs() @ b.abs().t())
    got = _gemm(golden, "random", kind, torch.float32)
    assert bool(((got - golden[f"gemm.random.{ref}.f32"]).abs() <= bound).all())
    got16, ref16 = (
        _gemm(golden, "random", kind, torch.bfloat16).float(),
        golden[f"gemm.random.{ref}.bf16"],
    )
    ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(ref16.float().abs())))
    assert bool(((got16 - ref16.float()).abs() <= ulp).all())


@pytest.mark.parametrize("tag", ["tiny", "flash"])
def test_index_scores_match_the_reference_bf16_order(
    golden: dict[str, torch.Tensor], tag: str
) -> None:
    q, k, w_raw = golden[f"index.{tag}.q"], golden[f"index.{tag}.k"], golden[f"index.{tag}.w"]
    head_dim = q.shape[-1]
    weights = w_raw.float() * (head_dim**-0.5 * q.shape[1] ** -0.5)
    scores = index_scores_qat(fake_quant_index_fp4(q), fake_quant_index_fp4(k), weights)
    assert torch.equal(scores, golden[f"index.{tag}.scores"].float())
    # the head weights as ops.indexer computes them from a bf16 projection round to the same bf16
    assert torch.equal(
        indexer_weights(w_raw.float(), torch.eye(q.shape[1]), head_dim=head_dim).bfloat16(),
        (w_raw * (head_dim**-0.5 * q.shape[1] ** -0.5)),
    )


def test_topk_on_qat_scores_breaks_ties_toward_the_smaller_index(
    golden: dict[str, torch.Tensor],
) -> None:
    scores = golden["index.tiny.scores"].float()
    n = scores.shape[1]
    picked = topk_indices(scores, torch.full((scores.shape[0],), n), 8).long()
    top = scores.gather(1, picked)
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter(1, picked, True)
    rest = torch.where(chosen, float("inf"), scores)
    assert bool((top.min(1).values >= rest.min(1).values).all())  # a valid top-k
    kth = top.min(1, keepdim=True).values
    j = torch.arange(n)
    tied_cuts = 0
    for t in range(scores.shape[0]):  # among scores equal to the cut, the smallest indices win
        tied = j[scores[t] == kth[t]]
        taken = picked[t][scores[t, picked[t]] == kth[t]]
        assert torch.equal(taken.sort().values, tied[: taken.numel()])
        tied_cuts += int(tied.numel() > taken.numel())
    assert tied_cuts >= 1  # the golden rows do contain a bf16 tie across the cut
    zeros = torch.zeros(2, 20)  # every index head inactive: relu zeros everywhere
    assert topk_indices(zeros, torch.tensor([20, 5]), 8).tolist() == [
        list(range(8)),
        [0, 1, 2, 3, 4, -1, -1, -1],
    ]


def _fixture_weight(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    with safe_open(SHARD1, "pt") as f:
        return f.get_tensor(f"{name}.weight"), f.get_tensor(f"{name}.scale")


def test_dequant_fp8_blocks_on_the_checkpoint() -> None:
    w, s = _fixture_weight("layers.0.attn.wq_b")  # [256, 64], scale [8, 2]
    rows = torch.arange(w.shape[0])[:, None] // 32
    cols = torch.arange(w.shape[1])[None, :] // 32
    expected = w.float() * e8m0_to_float(s)[rows, cols]
    got = dequant_fp8_blocks(w, s)
    assert torch.equal(got, expected)
    assert torch.equal(got.bfloat16().float(), got)  # wo_a-style bf16 dequantization is exact


def test_dequant_fp8_rows_on_the_engram_table() -> None:
    with safe_open(SHARD1.with_name("model-00003-of-00003.safetensors"), "pt") as f:
        table = f.get_tensor("layers.0.engram.embed.weight")  # [660, 32], scale [660, 1]
        scale = f.get_tensor("layers.0.engram.embed.scale")
    cols = torch.arange(table.shape[1]) // 32
    expected = table.float() * e8m0_to_float(scale)[:, cols]
    assert torch.equal(dequant_fp8_rows(table, scale), expected)
    assert torch.equal(dequant_fp8_rows(table[[3, 7]], scale[[3, 7]]), expected[[3, 7]])
    with pytest.raises(ValueError, match="scale shape"):
        dequant_fp8_rows(table, scale[:10])


def test_dequant_fp4_on_the_checkpoint() -> None:
    w, s = _fixture_weight("layers.0.ffn.experts.0.w2")  # [128, 32] packed, scale [128, 2]
    cols = torch.arange(2 * w.shape[1]) // 32
    expected = unpack_fp4(w) * e8m0_to_float(s)[:, cols]
    assert torch.equal(dequant_fp4(w, s), expected)


def test_linear_dispatch_and_none_mode() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    w8, s8 = _fixture_weight("layers.0.attn.wq_b")
    assert torch.equal(linear(x, w8, s8, "qat"), fp8_linear(x, w8, s8))
    none = linear(x, w8, s8, "none")
    assert torch.equal(none, F.linear(x, dequant_fp8_blocks(w8, s8).bfloat16()))
    w4, s4 = _fixture_weight("layers.0.ffn.experts.0.w2")
    assert torch.equal(
        linear(x, w4, s4, "qat", out_dtype=torch.float32),
        fp4_linear(x, w4, s4, out_dtype=torch.float32),
    )
    assert torch.equal(linear(x, w4, s4, "none"), F.linear(x, dequant_fp4(w4, s4).bfloat16()))
    dense = torch.randn(7, 64)
    assert torch.equal(linear(x, dense, None, "qat"), F.linear(x.float(), dense).bfloat16())
    # quantized numerics really differ from the exact ones
    assert not torch.equal(linear(x, w8, s8, "qat"), none)


def test_linear_errors_name_the_problem() -> None:
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    w8, s8 = _fixture_weight("layers.0.attn.wq_b")
    with pytest.raises(ValueError, match="needs its scale"):
        linear(x, w8, None, "qat")
    with pytest.raises(ValueError, match="takes no scale"):
        linear(x, torch.zeros(3, 64), s8, "qat")
    with pytest.raises(ValueError, match=r"scale shape \(2, 8\) != expected \(8, 2\)"):
        fp8_linear(x, w8, s8.t().contiguous())
    with pytest.raises(ValueError, match="in_features 64"):
        fp8_linear(torch.randn(2, 32), w8, s8)
    with pytest.raises(ValueError, match="unknown quant mode"):
        linear(x, w8, s8, "fp8")  # type: ignore[arg-type]


@pytest.mark.parametrize("storage", ["dense", "fp8", "fp4"])
def test_linear_module_holds_checkpoint_storage(storage: str) -> None:
    layer = Linear(64, 256, storage=storage, dtype=torch.bfloat16, device="cpu")  # type: ignore[arg-type]
    state = {k: (v.dtype, tuple(v.shape)) for k, v in layer.state_dict().items()}
    expected = {
        "dense": {"weight": (torch.bfloat16, (256, 64))},
        "fp8": {
            "weight": (torch.float8_e4m3fn, (256, 64)),
            "scale": (torch.float8_e8m0fnu, (8, 2)),
        },
        "fp4": {"weight": (torch.int8, (256, 32)), "scale": (torch.float8_e8m0fnu, (256, 2))},
    }[storage]
    assert state == expected
    with pytest.raises(ValueError, match="storage"):
        Linear(64, 256, storage="int4", dtype=torch.bfloat16, device="cpu")  # type: ignore[arg-type]


def test_linear_module_forward_on_checkpoint_weights() -> None:
    w, s = _fixture_weight("layers.0.attn.wq_b")
    layer = Linear(64, 256, storage="fp8", dtype=torch.bfloat16, device="cpu")
    layer.load_state_dict({"weight": w, "scale": s})
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(layer(x), fp8_linear(x, w, s))
    assert torch.equal(layer(x, "none"), linear(x, w, s, "none"))


def test_linear_checkpoint_slots_are_views_of_the_stored_rows() -> None:
    """A fused projection's part names its weight rows and their scale rows: fp8's 32-row
    blocks, fp4's rows; a dense weight has no scale."""
    fp8 = Linear(64, 96, storage="fp8", dtype=torch.bfloat16, device="cpu")
    head, tail = (
        fp8.checkpoint_slots("a.", slice(None, 64)),
        fp8.checkpoint_slots("b.", slice(64, None)),
    )
    assert list(head) == ["a.weight", "a.scale"] and list(tail) == ["b.weight", "b.scale"]
    assert head["a.weight"].data_ptr() == fp8.weight.data_ptr()
    assert tuple(head["a.weight"].shape) == (64, 64) and tuple(tail["b.weight"].shape) == (32, 64)
    assert fp8.scale is not None and tuple(fp8.scale.shape) == (3, 2)
    assert tuple(head["a.scale"].shape) == (2, 2) and tuple(tail["b.scale"].shape) == (1, 2)
    assert tail["b.scale"].data_ptr() == fp8.scale[2:].data_ptr()
    fp4 = Linear(64, 96, storage="fp4", dtype=torch.bfloat16, device="cpu")
    part = fp4.checkpoint_slots("c.", slice(40, 50))
    assert fp4.scale is not None and part["c.scale"].data_ptr() == fp4.scale[40:].data_ptr()
    assert tuple(part["c.weight"].shape) == (10, 32) and tuple(part["c.scale"].shape) == (10, 2)
    dense = Linear(64, 96, storage="dense", dtype=torch.float32, device="cpu")
    assert list(dense.checkpoint_slots("d.")) == ["d.weight"]


def test_quantize_fp8_blocks_round_trips_checkpoint_weights() -> None:
    """Re-quantizing a released fp8 weight gives back its codes and scales; a dense weight comes
    back within one e4m3 rounding (half a step: 2^-4 of the value, or of the block's subnormal
    spacing)."""
    from tests.model import dsv41_fixture as fx

    name = "layers.1.attn.wq_b"
    codes, scale = fx.tensor(f"{name}.weight"), fx.tensor(f"{name}.scale")
    dense = dequant_fp8_blocks(codes, scale)
    got_codes, got_scale = quantize_fp8_blocks(dense)
    back = dequant_fp8_blocks(got_codes, got_scale)
    assert torch.equal(back, dense)  # the same values (a block may pick a smaller scale)
    w = torch.randn(70, 45, generator=torch.Generator().manual_seed(3))
    c, s = quantize_fp8_blocks(w)
    assert c.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert tuple(s.shape) == fp8_scale_shape(70, 45)
    step = e8m0_to_float(s).repeat_interleave(32, 0)[:70].repeat_interleave(32, 1)[:, :45]
    err = (dequant_fp8_blocks(c, s) - w).abs()
    assert torch.all(err <= torch.maximum(w.abs() * 2.0**-4, step * 2.0**-10))
