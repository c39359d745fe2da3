from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from benchmarks.benchutil import (
    Table,
    device_info,
    finish,
    gbps,
    read_json,
    source_digest,
    summarize,
    tflops,
    time_cuda,
    time_graph,
    write_json,
)


def test_table_alignment_and_formats() -> None:
    t = Table(title="prepare", formats={"ms": "{:.3f}"})
    t.add(variant="serial", tokens=8192, ms=2.0)
    t.add({"variant": "multistream", "tokens": 8192}, ms=1.6, note=None)
    lines = str(t).splitlines()
    assert lines[0] == "prepare"
    assert lines[1].split() == ["variant", "tokens", "ms", "note"]
    assert set(lines[2].replace(" ", "")) == {"-"}
    assert lines[3] == "serial         8192  2.000"  # text left, numbers right, blank trailing
    assert lines[4] == "multistream    8192  1.600     -"  # an all-None column aligns right
    widths = {len(line) for line in lines[1:3]}
    assert len(widths) == 1  # header and rule share the width


def test_table_ratios() -> None:
    t = Table(["variant", "ms", "bytes"])
    t.add(variant="serial", ms=2.0, bytes=4e9, extra="ignored")
    t.add(variant="cp4", ms=0.5, bytes=4e9)
    t.add(variant="broken", ms=None, bytes=0)
    t.add_relative("speedup", "ms", baseline={"variant": "serial"}, invert=True)
    t.add_relative("rel", "ms")
    t.add_ratio("B/ms", "bytes", "ms", fmt="{:.1e}")
    assert [r["speedup"] for r in t.rows] == [1.0, 4.0, None]
    assert [r["rel"] for r in t.rows] == [1.0, 0.25, None]
    assert t.rows[2]["B/ms"] is None
    assert t.columns == ["variant", "ms", "bytes", "speedup", "rel", "B/ms"]
    out = t.render()
    assert "4.00x" in out and "2.0e+09" in out and "extra" not in out
    with pytest.raises(KeyError):
        t.add_relative("x", "ms", baseline={"variant": "nope"})
    md = t.render("markdown").splitlines()
    assert md[0].startswith("| variant") and md[1].startswith("| ---")
    assert md[1].endswith(": |") and all(line.endswith(" |") for line in md)
    with pytest.raises(ValueError):
        t.render("html")


def test_table_default_float_format() -> None:
    t = Table()
    t.add(a=1234.5678, b=0.012345, c=3.14159, d=2e-7, e=0.0, f=True, g="x")
    row = str(t).splitlines()[-1].split()
    assert row == ["1234.6", "0.0123", "3.142", "2.000e-07", "0", "True", "x"]


@dataclasses.dataclass
class _Cfg:
    cp: int
    dtype: torch.dtype


def test_write_json_round_trip(tmp_path: Path) -> None:
    payload = {
        "results": [{"variant": "serial", "ms": 1.25, "tokens": 8192}],
        "config": _Cfg(cp=4, dtype=torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "shape": (2, 3),
        "path": tmp_path,
    }
    out = tmp_path / "deep" / "bench.json"
    written = write_json(out, payload)
    back = read_json(out)
    assert back == written == json.loads(out.read_text())
    assert back["results"] == payload["results"]
    assert back["config"] == {"cp": 4, "dtype": "torch.bfloat16"}
    assert back["scalar"] == 3.5 and back["shape"] == [2, 3] and back["path"] == str(tmp_path)
    meta = back["meta"]
    assert meta["argv"] == sys.argv
    assert meta["date"].endswith("+00:00")
    assert meta["device"]["torch"] == torch.__version__
    assert meta["source_digest"] == source_digest() and len(meta["source_digest"]) == 12
    assert not list(out.parent.glob(".*tmp*"))
    with pytest.raises(ValueError):
        write_json(out, {"meta": 1})
    with pytest.raises(TypeError):
        write_json(out, {"bad": object()})


def test_finish_writes_the_payload_with_the_device_and_returns_the_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sub" / "bench.json"
    assert finish(out, {"benchmark": "x", "rows": [1]}) == 0
    back = read_json(out)
    assert back["benchmark"] == "x" and back["rows"] == [1]
    assert back["device"] == back["meta"]["device"] == json.loads(json.dumps(device_info()))
    assert f"wrote {out}" in capsys.readouterr().out
    assert finish(out, {"benchmark": "x"}, ok=False) == 1


def test_device_info() -> None:
    info = device_info()
    assert info["torch"] == torch.__version__
    assert info["device"] in ("cpu", "cuda")
    if info["device"] == "cuda":
        assert info["sm_count"] > 0 and info["gpu_name"]
    else:
        assert info["cpu_count"] >= 1
    json.dumps(info)


def test_rates() -> None:
    assert tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert tflops(1e12, 1.0) == pytest.approx(1000.0)
    assert gbps(4e9, 2.0) == pytest.approx(2000.0)
    with pytest.raises(ValueError):
        gbps(1.0, 0.0)


def test_summarize() -> None:
    s = summarize([3.0, 1.0, 2.0, 4.0])
    assert s["median_ms"] == 2.5 and s["mean_ms"] == 2.5
    assert s["min_ms"] == 1.0 and s["max_ms"] == 4.0 and s["iters"] == 4
    assert s["p10_ms"] == pytest.approx(1.3) and s["p90_ms"] == pytest.approx(3.7)
    with pytest.raises(ValueError):
        summarize([])


def test_time_cuda_cpu_path() -> None:
    calls = []
    stats = time_cuda(lambda: calls.append(1), warmup=3, iters=7, device="cpu")
    assert len(calls) == 10
    assert stats["iters"] == 7 and stats["timer"] == "perf_counter"
    assert 0 <= stats["min_ms"] <= stats["median_ms"] <= stats["max_ms"]
    with pytest.raises(ValueError):
        time_cuda(lambda: None, iters=0, device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_time_graph_needs_cuda() -> None:
    with pytest.raises(RuntimeError, match="CUDA"):
        time_graph(lambda: None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_time_cuda_and_graph_gpu() -> None:
    a = torch.randn(1024, 1024, device="cuda")
    out = torch.empty_like(a)

    def fn() -> None:
        torch.mm(a, a, out=out)

    eager = time_cuda(fn, warmup=3, iters=10, flush_l2=True)
    graph = time_graph(fn, warmup=3, iters=10, replays_per_iter=4)
    assert eager["timer"] == "cuda_event" and graph["timer"] == "cuda_graph"
    assert eager["median_ms"] > 0 and graph["median_ms"] > 0
    torch.testing.assert_close(out, a @ a)
