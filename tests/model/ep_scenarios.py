"""Shared expert-parallelism scenarios (tests/model/test_ep.py, tests/gpu/test_ep_gloo_cuda.py)."""

from __future__ import annotations

from dataclasses import replace

import torch

from dsv4cp.config import DeepseekV41Config
from dsv4cp.quantization_config import QuantizationConfig
from dsv4cp.tools.checking import Scenario
from tests.model import dsv41_fixture as fx

# The pair state of ratio-2 layers is an fp32 GEMM whose CPU summation order follows the row
# count (tests/model/test_whole_model_qat.py): CP changes it by an ulp, EP does not touch it.
FP32_STATE = ("pair_kv", "pair_gate")


def tiny12(quant: bool) -> DeepseekV41Config:
    """tiny_full with 12 routed experts (2, 3, 4 divide it), in released storage when `quant`."""
    cfg = replace(DeepseekV41Config.tiny_full(), n_routed_experts=12)
    if quant:
        q = QuantizationConfig(weight_block_size=(32, 32), scale_fmt="ue8m0", expert_dtype="fp4")
        cfg = replace(cfg, quantization=q)
    return cfg


def tiny12_qat(device: str = "cpu", lens: tuple[int, ...] = (7, 30)) -> Scenario:
    return Scenario(
        lens=lens,
        prefix=(0, 5),
        config=tiny12(True),
        quant="qat",
        dtype="bfloat16",
        device=device,
    )


def fixture_qat(device: str = "cpu", lens: tuple[int, ...] = (31, 20)) -> Scenario:
    """The tiny released-format checkpoint (8 experts: EP = 2, 4) in qat."""
    return Scenario(
        lens=lens,
        prefix=(0, 7),
        checkpoint=str(fx.CHECKPOINT),
        quant="qat",
        dtype="bfloat16",
        device=device,
    )


def differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """Key → max |difference| of every entry that is not bit-identical (and missing keys)."""
    out = {k: float("inf") for k in set(got) ^ set(want)}
    for k in sorted(set(got) & set(want)):
        a, b = got[k], want[k]
        if a.shape != b.shape:
            out[k] = float("inf")
        elif not torch.equal(a, b):
            out[k] = float((a.float() - b.float()).abs().max())
    return out


def is_fp32_state(key: str) -> bool:
    return key.startswith("cache/") and key.split("/")[1].split(".")[0] in FP32_STATE
