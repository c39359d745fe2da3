"""`dsv4cp cache-size`: the plan as a table or JSON, the Flash figure, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4cp.cache import cache_bytes
from dsv4cp.cli import main
from dsv4cp.config import DeepseekV41Config

FLASH_JSON = Path(__file__).resolve().parent / "fixtures" / "deepseek-v41-flash-config.json"


def _json(argv: list[str], capsys: pytest.CaptureFixture) -> dict:
    assert main(["cache-size", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_flash_128k_json(capsys: pytest.CaptureFixture) -> None:
    out = _json(["--tokens", "128K"], capsys)
    assert out["tokens"] == 131072 and out["quant"] == "qat"
    assert set(out["by_kind"]) == {
        "swa_window",
        "compressed",
        "index_keys",
        "pair_state",
        "slot_tables",
    }
    assert out["bytes_total"] == sum(out["by_kind"].values())
    assert out["bytes_per_token"] == out["bytes_total"] / 131072 <= 950
    want = cache_bytes(DeepseekV41Config.flash(), 131072)
    assert out["by_kind"] == want.by_kind


def test_config_path_quant_none_and_every_slot(capsys: pytest.CaptureFixture) -> None:
    path = _json(["--config", str(FLASH_JSON), "--tokens", "4096"], capsys)
    preset = _json(["--tokens", "4096"], capsys)
    assert path["by_kind"] == preset["by_kind"]
    dense = _json(["--tokens", "4096", "--quant", "none", "--every-slot"], capsys)
    assert dense["by_kind"]["swa_window"] == 40 * 4096 * 1024  # a bf16 row per layer and slot
    assert 55_000 < dense["bytes_per_token"] < 58_400  # the "~57 KiB per token"
    fp32 = _json(["--tokens", "4096", "--quant", "none", "--dtype", "fp32"], capsys)
    assert fp32["by_kind"]["compressed"] == 2 * dense["by_kind"]["compressed"]


def test_sglang_swa_pool_ratio(capsys: pytest.CaptureFixture) -> None:
    """The served layout (docs/sglang.md, *Caches*): SWA rows and pair state on SGLang's SWA
    pool of R · slots; between the windowed runner and a row per slot, growing with R."""
    argv = ["--tokens", "128K", "--page-size", "256"]
    out = _json([*argv, "--swa-full-ratio", "0.1"], capsys)
    want = cache_bytes(DeepseekV41Config.flash(), 131072, page_size=256, swa_full_ratio=0.1)
    assert out["by_kind"] == want.by_kind and out["swa"] == "SGLang SWA pool, ratio 0.1"
    every = _json([*argv, "--every-slot"], capsys)
    window = _json(argv, capsys)
    half = _json([*argv, "--swa-full-ratio", "0.05"], capsys)
    assert window["bytes_per_token"] < half["bytes_per_token"] < out["bytes_per_token"]
    assert out["bytes_per_token"] < every["bytes_per_token"]
    for kind in ("compressed", "index_keys"):
        assert out["by_kind"][kind] == every["by_kind"][kind]


def test_table(capsys: pytest.CaptureFixture) -> None:
    assert main(["cache-size", "--config", "tiny", "--tokens", "1000", "--page-size", "8"]) == 0
    text = capsys.readouterr().out
    assert "1000 tokens (tiny, quant qat, page 8, SWA window" in text
    assert all(k in text for k in ("swa_window", "compressed", "index_keys", "pair_state", "total"))


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--tokens", "-5"], "--tokens must be a non-negative integer"),
        (["--tokens", "12x"], "--tokens must be a non-negative integer"),
        (["--tokens", "5", "--page-size", "0"], "--page-size must be >= 1"),
        (["--tokens", "5", "--quant", "fp8"], "--quant must be qat or none"),
        (["--tokens", "5", "--dtype", "fp16"], "--dtype must be bf16 or fp32"),
        (["--tokens", "5", "--config", "/no/such/dir"], "no config.json at /no/such/dir"),
        (["--tokens", "5", "--swa-full-ratio", "0"], "--swa-full-ratio must be in (0, 1]"),
        (["--tokens", "5", "--swa-full-ratio", "nan"], "--swa-full-ratio must be in (0, 1]"),
        (["--tokens", "5", "--swa-full-ratio", "x"], "--swa-full-ratio must be in (0, 1]"),
        (["--tokens", "5", "--swa-full-ratio", "0.1", "--every-slot"], "two different SWA"),
        (["--tokens", "4M"], "--tokens 4,194,304 is longer than the model's context"),
        (["--tokens", "²"], "--tokens must be a non-negative integer"),
        (["--tokens", "5", "--page-size", "³k"], "--page-size must be a non-negative integer"),
        (["--tokens", "5", "--page-size", "2M"], "--page-size 2,097,152 is larger than the model"),
        (["--tokens", "5", "--page-size", str(10**20)], "is larger than the model's context"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, msg, capsys: pytest.CaptureFixture) -> None:  # noqa: ANN001
    assert main(["cache-size", *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1
