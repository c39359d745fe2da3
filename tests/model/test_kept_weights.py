"""bf16 copies of fp8 weights for the cuBLAS GEMM route (`Linear.keep_dequantized`,
`DeepseekV41Model.keep_dequantized_weights`, $DSV4CP_KEEP_BF16_WEIGHTS in the loader): the copy
is the exact dequantized weight, follows in-place writes of the weight and scale, stays out of
the state dict, and the scopes hold what they name. That the cuBLAS route reads the copy (and the
same bits come out) is the GPU test tests/kernels/test_fp8_linear.py::test_kept_dense_weight_*."""

from __future__ import annotations

import logging

import pytest
import torch

from dsv4cp.config import DeepseekV41Config
from dsv4cp.layers.linear import KEEP_BF16_ENV, Linear, kept_weights_scope
from dsv4cp.loader import load_checkpoint
from dsv4cp.model import DeepseekV41Model
from dsv4cp.ops import linear as ops_linear
from tests.model import dsv41_fixture as fx


def _fp8_linear(n: int = 96, k: int = 64, seed: int = 0) -> Linear:
    g = torch.Generator().manual_seed(seed)
    lin = Linear(k, n, storage="fp8", dtype=torch.bfloat16, device="cpu")
    lin.weight.copy_((torch.randn(n, k, generator=g) * 8).to(torch.float8_e4m3fn))
    codes = torch.randint(120, 130, lin.scale.shape, dtype=torch.uint8, generator=g)  # type: ignore[union-attr]
    lin.scale.copy_(codes.view(torch.float8_e8m0fnu))  # type: ignore[union-attr]
    return lin


def _dequantized(lin: Linear) -> torch.Tensor:
    assert lin.scale is not None
    return ops_linear.dequant_fp8_blocks(lin.weight, lin.scale, out_dtype=torch.bfloat16)


def test_the_copy_is_the_dequantized_weight_and_not_in_the_state_dict() -> None:
    lin = _fp8_linear()
    assert lin.dense is None
    assert lin.keep_dequantized() == 96 * 64 * 2
    assert lin.dense is not None and torch.equal(lin.dense, _dequantized(lin))
    assert set(lin.state_dict()) == {"weight", "scale"}
    assert "kept bf16 copy" in repr(lin)
    assert lin.keep_dequantized(False) == 0 and lin.dense is None


def test_the_copy_follows_in_place_writes_of_weight_and_scale() -> None:
    lin, other = _fp8_linear(seed=0), _fp8_linear(seed=1)
    lin.keep_dequantized()
    x = torch.randn(3, 64).bfloat16()
    lin(x)
    lin.weight.copy_(other.weight)  # a later load writes in place
    lin(x)
    assert lin.dense is not None and torch.equal(lin.dense, _dequantized(lin))
    assert other.scale is not None and lin.scale is not None
    lin.scale.copy_(other.scale)
    lin(x)
    assert torch.equal(lin.dense, _dequantized(other))


def test_output_is_unchanged_on_the_twin_route() -> None:
    lin = _fp8_linear()
    x = torch.randn(5, 64).bfloat16()
    before = lin(x)
    lin.keep_dequantized()
    assert torch.equal(lin(x), before)


@pytest.mark.parametrize(
    ("storage", "dtype"),
    [("dense", torch.bfloat16), ("fp4", torch.bfloat16), ("fp8", torch.float32)],
)
def test_weights_the_route_never_takes_keep_nothing(storage: str, dtype: torch.dtype) -> None:
    lin = Linear(64, 32, storage=storage, dtype=dtype, device="cpu")  # type: ignore[arg-type]
    assert lin.keep_dequantized() == 0 and lin.dense is None


def test_a_wrong_dense_weight_is_refused() -> None:
    lin = _fp8_linear()
    assert lin.scale is not None
    x = torch.randn(2, 64).bfloat16()
    good = _dequantized(lin)
    assert torch.equal(
        ops_linear.fp8_linear(x, lin.weight, lin.scale, dense=good),
        ops_linear.fp8_linear(x, lin.weight, lin.scale),
    )
    for bad in (good.float(), good[:, :32], good.t().contiguous().t()[:, :64][:95]):
        with pytest.raises(ValueError, match="dense weight must be contiguous bf16"):
            ops_linear.fp8_linear(x, lin.weight, lin.scale, dense=bad)
    with pytest.raises(ValueError, match="dense weight"):
        ops_linear.fp8_linear(x, lin.weight, lin.scale, dense=torch.empty(64, 96).bfloat16().t())


def _fp8_bytes(module: torch.nn.Module) -> int:
    return sum(
        m.weight.numel() * 2
        for m in module.modules()
        if isinstance(m, Linear) and m.storage == "fp8" and m.dtype == torch.bfloat16
    )


def test_model_scopes_hold_what_they_name() -> None:
    model = DeepseekV41Model(
        DeepseekV41Config.from_hf(fx.CHECKPOINT), dtype=torch.bfloat16, seed=None
    )
    attention = sum(_fp8_bytes(b.attn) for b in model.blocks)
    everything = _fp8_bytes(model)
    assert 0 < attention < everything  # the fixture's shared experts are fp8 too
    assert model.keep_dequantized_weights("attention") == attention
    held = [m for m in model.modules() if isinstance(m, Linear) and m.dense is not None]
    assert sum(m.dense.numel() * 2 for m in held) == attention  # type: ignore[union-attr]
    assert model.keep_dequantized_weights("all") == everything
    assert model.keep_dequantized_weights("off") == 0
    assert not [m for m in model.modules() if isinstance(m, Linear) and m.dense is not None]
    with pytest.raises(ValueError, match="scope 'bf16'"):
        model.keep_dequantized_weights("bf16")  # type: ignore[arg-type]


def test_environment_scope(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEEP_BF16_ENV, raising=False)
    assert kept_weights_scope() == "off"
    monkeypatch.setenv(KEEP_BF16_ENV, " Attention ")
    assert kept_weights_scope() == "attention"
    monkeypatch.setenv(KEEP_BF16_ENV, "yes")
    with pytest.raises(ValueError, match=KEEP_BF16_ENV):
        kept_weights_scope()


def test_loader_keeps_the_scope_the_environment_names(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(KEEP_BF16_ENV, "attention")
    model = DeepseekV41Model(
        DeepseekV41Config.from_hf(fx.CHECKPOINT), dtype=torch.bfloat16, seed=None
    )
    with caplog.at_level(logging.INFO, logger="dsv4cp.loader"):
        report = load_checkpoint(model, fx.CHECKPOINT)
    assert report.kept_bf16_bytes == sum(_fp8_bytes(b.attn) for b in model.blocks) > 0
    lin = model.blocks[0].attn.wq_b
    assert isinstance(lin, Linear) and lin.dense is not None
    assert torch.equal(lin.dense, _dequantized(lin))  # made after the load, from loaded weights
    assert any("holding bf16 copies" in r.getMessage() for r in caplog.records)


def test_a_bad_scope_is_refused_before_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEEP_BF16_ENV, "bf16")
    model = DeepseekV41Model(
        DeepseekV41Config.from_hf(fx.CHECKPOINT), dtype=torch.bfloat16, seed=None
    )
    before = model.embed.clone()  # uninitialized (seed=None): compared as bytes, NaN or not
    with pytest.raises(ValueError, match=KEEP_BF16_ENV):
        load_checkpoint(model, fx.CHECKPOINT, progress=lambda line: pytest.fail(line))
    assert torch.equal(model.embed.view(torch.uint8), before.view(torch.uint8))  # nothing read
