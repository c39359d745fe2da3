"""The GPU-only benchmarks import on a CPU machine and refuse to run there with a message and
exit status 2 (their results come from the H200: benchmarks/results/)."""

from __future__ import annotations

import importlib

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
@pytest.mark.parametrize("name", ["fp4_dequant", "fp8_dequant", "indexer_scan", "layer_profile"])
def test_refuses_without_cuda(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    bench = importlib.import_module(f"benchmarks.{name}")
    assert bench.main(["--out", "/nonexistent/never-written.json"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
