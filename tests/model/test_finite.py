"""Non-finite numbers are found, not served: NaN/inf weights fail at load naming the tensor, and
DSV4CP_CHECK_FINITE=1 names the first layer (and row) whose output is not finite."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4cp.config import DeepseekV41Config
from dsv4cp.cp.launch import run_cp
from dsv4cp.model import DeepseekV41Model
from dsv4cp.runner import PrefillRunner

PROMPT = list(range(3, 40))


def _model() -> DeepseekV41Model:
    return DeepseekV41Model(DeepseekV41Config.tiny(), seed=0)


@pytest.mark.parametrize(
    "name,index,value",
    [
        ("layers.2.attn.wq_b.weight", (0, 0), float("nan")),
        ("embed.weight", (7, 3), float("inf")),
        ("layers.0.ffn.w1.weight", (5, 1), float("-inf")),
    ],
)
def test_from_pretrained_refuses_non_finite_weights(
    tmp_path: Path, name: str, index: tuple[int, int], value: float
) -> None:
    model = _model()
    model.save_pretrained(tmp_path)
    tensors = {k: v.detach().clone() for k, v in model.checkpoint_weights().items()}
    tensors[name][index] = value
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError, match=rf"'{name}': non-finite value {value} at index \[{index[0]}, {index[1]}\]"
    ):
        DeepseekV41Model.from_pretrained(tmp_path)
    # load_state writes nothing when any tensor is bad
    target = _model()
    before = {k: v.clone() for k, v in target.checkpoint_weights().items()}
    tensors["head.weight"] = tensors["head.weight"] + 1  # a good tensor that would change
    with pytest.raises(ValueError, match=name):
        target.load_state(tensors)
    for k, v in target.checkpoint_weights().items():
        assert torch.equal(v, before[k]), k


def _poison(model: DeepseekV41Model, layer: int) -> None:
    with torch.no_grad():
        model.blocks[layer].ffn.w1[4, 0] = float("nan")


def test_check_finite_names_the_layer_and_row(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSV4CP_CHECK_FINITE", "1")
    model = _model()
    _poison(model, 3)
    runner = PrefillRunner(model, num_slots=256, max_context=128)
    with pytest.raises(
        ValueError,
        match=r"hidden rows after layer 3: non-finite value nan at index \[0, \d+\] "
        r"\(row 0 = global token 0\)",
    ):
        runner.prefill({"a": PROMPT})
    assert runner.alloc.requests == {}  # the failed batch was rolled back


@pytest.mark.parametrize("name", ["layers.3.ffn.w1.weight", "layers.2.attn.wq_b.weight"])
def test_without_the_check_nan_reaches_the_logits(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # wq_b: one NaN query head; the sparse attention used to turn it into a finite, wrong 0
    monkeypatch.delenv("DSV4CP_CHECK_FINITE", raising=False)
    model = _model()
    with torch.no_grad():
        model.checkpoint_weights()[name][0, 0] = float("nan")
    out = PrefillRunner(model, num_slots=256, max_context=128).prefill({"a": PROMPT})
    assert not torch.isfinite(out.logits).any()


def test_check_finite_env_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSV4CP_CHECK_FINITE", "2")
    with pytest.raises(ValueError, match="DSV4CP_CHECK_FINITE must be 1 or 0 .*, got '2'"):
        _model()


def _cp_rank(group, layer: int):  # noqa: ANN001, ANN202
    model = _model()
    _poison(model, layer)
    return PrefillRunner(model, cp=group, num_slots=256, max_context=128).prefill({"a": PROMPT})


def test_check_finite_under_cp_names_a_global_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSV4CP_CHECK_FINITE", "1")
    with pytest.raises(ValueError, match=r"after layer 1: .*\(row 0 = global token [01]\)"):
        run_cp(2, _cp_rank, 1, backend="fake")
