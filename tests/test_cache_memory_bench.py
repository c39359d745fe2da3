"""benchmarks/cache_memory.py runs on the CPU at tiny dims (--smoke) and reports every kind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks.cache_memory import main


def test_smoke_run_writes_the_report(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "cm.json"
    assert main(["--smoke", "--layers", "4", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "cache, all kinds" in text and "weights (attention layers)" in text
    res = json.loads(out.read_text())["cache_memory"]
    assert res["layers"] == 4 and res["context_tokens"] == 512 and res["chunk_tokens"] == 64
    assert set(res["cache_bytes_allocated"]) == set(res["cache_bytes_plan"])
    # the prefix walk handed old SWA pages back: the window and the chunk are what is held
    assert res["swa_pages_held_after"] * res["page_size"] < res["context_tokens"]
