"""The GPU-only benchmarks import on a CPU machine and refuse to run there with a message and
exit status 2 (their results come from the H200: benchmarks/results/)."""

from __future__ import annotations

import importlib

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
@pytest.mark.parametrize(
    "name",
    [
        "fp4_dequant",
        "fp8_dequant",
        "fp8_gemm_gluon",
        "indexer_scan",
        "layer_profile",
        "logits_int8",
        "logits_selection",
    ],
)
def test_refuses_without_cuda(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    bench = importlib.import_module(f"benchmarks.{name}")
    assert bench.main(["--out", "/nonexistent/never-written.json"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_layer_profile_refuses_a_layer_list_first(capsys: pytest.CaptureFixture[str]) -> None:
    bench = importlib.import_module("benchmarks.layer_profile")
    assert bench.main(["--layers", "24", "--out", "/nonexistent/never-written.json"]) == 2
    assert "layer 24 reads what layer(s) [20] publish" in capsys.readouterr().err
