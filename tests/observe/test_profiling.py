from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsv4cp.observe.profiling import Kernel, Trace, capture_trace
from dsv4cp.observe.timeline import (
    busy_fraction,
    concurrency,
    overlap_fraction,
    overlap_intervals,
    plot_timeline,
    span,
    timeline_stats,
)
from dsv4cp.observe.timing import nvtx_range

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- overlap metric


def test_overlap_none() -> None:
    ks = [("a", 7, 0.0, 10.0), ("b", 8, 10.0, 20.0), ("c", 7, 25.0, 30.0)]
    assert overlap_fraction(ks) == 0.0
    assert overlap_intervals(ks) == []


def test_overlap_full() -> None:
    ks = [("a", 7, 0.0, 10.0), ("b", 8, 0.0, 10.0)]
    assert overlap_fraction(ks) == 1.0
    assert overlap_intervals(ks) == [(0.0, 10.0)]


def test_overlap_partial() -> None:
    ks = [("a", 7, 0.0, 10.0), ("b", 8, 5.0, 20.0)]
    assert overlap_fraction(ks) == pytest.approx(5.0 / 20.0)
    assert overlap_intervals(ks) == [(5.0, 10.0)]
    # explicit window clips everything
    assert overlap_fraction(ks, (5.0, 10.0)) == 1.0
    assert overlap_fraction(ks, (0.0, 40.0)) == pytest.approx(5.0 / 40.0)
    assert overlap_fraction(ks, (12.0, 12.0)) == 0.0
    with pytest.raises(ValueError):
        overlap_fraction(ks, (3.0, 1.0))


def test_overlap_three_streams() -> None:
    ks = [("m", 0, 0.0, 30.0), ("a0", 1, 10.0, 20.0), ("a2", 2, 15.0, 25.0)]
    # ≥2 streams on [10, 25): 15 of 30
    assert overlap_fraction(ks) == pytest.approx(0.5)
    # ≥3 streams on [15, 20)
    assert overlap_fraction(ks, min_streams=3) == pytest.approx(5.0 / 30.0)
    hist = concurrency(ks)
    assert hist == pytest.approx({1: 15.0, 2: 10.0, 3: 5.0})
    assert busy_fraction(ks) == pytest.approx({0: 1.0, 1: 1 / 3, 2: 1 / 3})


def test_nested_intervals_one_stream_count_once() -> None:
    ks = [("outer", 7, 0.0, 10.0), ("inner", 7, 2.0, 8.0), ("touch", 7, 10.0, 12.0)]
    assert overlap_fraction(ks) == 0.0
    assert busy_fraction(ks) == {7: 1.0}
    # a second stream overlapping only the nested part
    ks.append(("side", 9, 3.0, 4.0))
    assert overlap_fraction(ks) == pytest.approx(1.0 / 12.0)


def test_empty_and_gaps() -> None:
    assert overlap_fraction([]) == 0.0
    assert span([]) == (0.0, 0.0)
    ks = [Kernel("a", 1, 0.0, 1.0), Kernel("b", 2, 0.5, 1.0), Kernel("c", 1, 9.0, 10.0)]
    assert span(ks) == (0.0, 10.0)
    assert overlap_fraction(ks) == pytest.approx(0.05)
    assert concurrency(ks)[0] == pytest.approx(8.0)  # idle gap


def test_overlap_exact_against_bruteforce() -> None:
    g = torch.Generator().manual_seed(0)
    ks = []
    for i in range(60):
        s = int(torch.randint(0, 1000, (1,), generator=g))
        d = int(torch.randint(1, 80, (1,), generator=g))
        ks.append((f"k{i}", i % 4, float(s), float(s + d)))
    lo, hi = span(ks)
    count = 0
    for t in range(int(lo), int(hi)):  # unit cells: integer endpoints make this exact
        busy = {st for _, st, s, e in ks if s <= t < e}
        count += len(busy) >= 2
    assert overlap_fraction(ks) == pytest.approx(count / (hi - lo), abs=1e-12)


# ----------------------------------------------------------------------------- Trace.load


def _write_trace(path: Path) -> None:
    pid, tid = 100, 100
    events = [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "python"}},
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": "layer0/gather",
            "pid": pid,
            "tid": tid,
            "ts": 1000.0,
            "dur": 10.0,
            "args": {},
        },
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": "layer0/prepare",
            "pid": pid,
            "tid": tid,
            "ts": 1012.0,
            "dur": 20.0,
            "args": {},
        },
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "aten::mm",
            "pid": pid,
            "tid": tid,
            "ts": 1013.0,
            "dur": 2.0,
            "args": {},
        },
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "pid": pid,
            "tid": tid,
            "ts": 1002.0,
            "dur": 1.0,
            "args": {"correlation": 1},
        },
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "pid": pid,
            "tid": tid,
            "ts": 1004.0,
            "dur": 1.0,
            "args": {"correlation": 2},
        },
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "pid": pid,
            "tid": tid,
            "ts": 1014.0,
            "dur": 1.0,
            "args": {"correlation": 3},
        },
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "pid": pid,
            "tid": tid,
            "ts": 1016.0,
            "dur": 1.0,
            "args": {"correlation": 4},
        },
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaMemcpyAsync",
            "pid": pid,
            "tid": tid,
            "ts": 1018.0,
            "dur": 1.0,
            "args": {"correlation": 5},
        },
        # GPU: stream 7 = default, stream 20 = side
        {
            "ph": "X",
            "cat": "kernel",
            "name": "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgs)",
            "pid": 0,
            "tid": 7,
            "ts": 1010.0,
            "dur": 30.0,
            "args": {"device": 0, "stream": 7, "correlation": 1},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "rerange_rows_kernel",
            "pid": 0,
            "tid": 7,
            "ts": 1040.0,
            "dur": 5.0,
            "args": {"device": 0, "stream": 7, "correlation": 2},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "sm90_xmma_gemm_bf16",
            "pid": 0,
            "tid": 7,
            "ts": 1045.0,
            "dur": 40.0,
            "args": {"device": 0, "stream": 7, "correlation": 3},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "store_swa_k_kernel",
            "pid": 0,
            "tid": 20,
            "ts": 1050.0,
            "dur": 20.0,
            "args": {"device": 0, "stream": 20, "correlation": 4},
        },
        {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": "Memcpy DtoD (Device -> Device)",
            "pid": 0,
            "tid": 20,
            "ts": 1075.0,
            "dur": 5.0,
            "args": {"device": 0, "stream": 20, "correlation": 5},
        },
        {
            "ph": "X",
            "cat": "gpu_user_annotation",
            "name": "layer0/prepare",
            "pid": 0,
            "tid": "stream 7 ",  # older kineto labels the lane
            "ts": 1045.0,
            "dur": 40.0,
            "args": {"device": 0},
        },
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 1, "pid": pid, "tid": tid, "ts": 1002.0},
    ]
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))


def test_trace_load_two_streams(tmp_path: Path) -> None:
    p = tmp_path / "trace.json"
    _write_trace(p)
    tr = Trace.load(p)
    assert tr.devices() == [0]
    assert tr.streams() == [7, 20]
    ks = tr.kernels()
    assert [k.name.split("(")[0] for k in ks] == [
        "ncclDevKernel_AllGather_RING_LL",
        "rerange_rows_kernel",
        "sm90_xmma_gemm_bf16",
        "store_swa_k_kernel",
        "Memcpy DtoD ",
    ]
    assert ks[0] == Kernel(ks[0].name, 7, 1010.0, 1040.0)
    _, stream, s, e = ks[3]
    assert (stream, s, e) == (20, 1050.0, 1070.0)
    assert len(tr.kernels(cats=("kernel",))) == 4

    assert [r.name for r in tr.ranges("layer0/")] == ["layer0/gather", "layer0/prepare"]
    assert tr.range_names("layer0/p") == ["layer0/prepare"]
    assert tr.ranges("layer0/", gpu=True)[0].lane == 7
    assert tr.window("layer0/") == (1000.0, 1032.0)
    with pytest.raises(KeyError):
        tr.window("nope")

    # correlation attribution: launched inside the CPU range, on any stream
    prep = tr.kernels_in("layer0/prepare")
    assert {k.name for k in prep} == {
        "sm90_xmma_gemm_bf16",
        "store_swa_k_kernel",
        "Memcpy DtoD (Device -> Device)",
    }
    gathers = tr.gather_kernels()
    assert [k.name for k in gathers] == ["ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgs)"]
    tagged = tr.gather_kernels(patterns=(), tags=("gather",))
    assert [k.name for k in tagged][:2] == [
        "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgs)",
        "rerange_rows_kernel",
    ]

    # prepare window = first..last kernel of the prepare: GEMM overlaps SWA store 20 of 40 µs
    w = span(prep)
    assert w == (1045.0, 1085.0)
    assert overlap_fraction(ks, w) == pytest.approx((20.0 + 5.0) / 40.0)
    stats = timeline_stats(ks)
    assert stats["n_kernels"] == 5 and stats["streams"] == [7, 20]
    assert stats["gather_busy_us"] == pytest.approx(30.0)
    json.dumps(stats)


def test_trace_multi_device_needs_device(tmp_path: Path) -> None:
    ev = [
        {
            "ph": "X",
            "cat": "kernel",
            "name": "k",
            "pid": d,
            "tid": 7,
            "ts": 0.0,
            "dur": 1.0,
            "args": {"device": d, "stream": 7},
        }
        for d in (0, 1)
    ]
    p = tmp_path / "t.json"
    p.write_text(json.dumps(ev))  # bare event list is also accepted
    tr = Trace.load(p)
    with pytest.raises(ValueError, match="device"):
        tr.kernels()
    assert len(tr.kernels(device=1)) == 1


# ----------------------------------------------------------------------------- plot


def test_plot_timeline_png(tmp_path: Path) -> None:
    ks = [
        ("ncclDevKernel_AllGather", 7, 0.0, 30.0),
        ("gemm", 7, 35.0, 80.0),
        ("store_swa_k", 20, 40.0, 60.0),
        ("compressor", 21, 45.0, 70.0),
        ("zero_len", 21, 75.0, 75.0),
    ]
    out = tmp_path / "sub" / "timeline.png"
    frac = plot_timeline(ks, out, title="layer 0 prepare", stream_names={7: "M", 20: "A0"})
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000
    assert frac == pytest.approx(overlap_fraction(ks))
    out2 = tmp_path / "win.png"
    plot_timeline(ks, out2, title="window", window=(30.0, 80.0))
    assert out2.read_bytes()[:8] == PNG_MAGIC


def test_plot_timeline_no_kernels(tmp_path: Path) -> None:
    out = tmp_path / "empty.png"
    assert plot_timeline([], out, title="cpu only") == 0.0
    assert out.read_bytes()[:8] == PNG_MAGIC


# ----------------------------------------------------------------------------- nvtx + capture


def test_nvtx_range_without_profiler() -> None:
    with nvtx_range("outer"), nvtx_range("inner"):
        x = torch.ones(3).sum()
    assert float(x) == 3.0
    with pytest.raises(RuntimeError, match="boom"), nvtx_range("raises"):
        raise RuntimeError("boom")

    @nvtx_range("decorated")
    def fact(n: int) -> int:  # recursion reuses the decorator: each call needs its own state
        return 1 if n <= 1 else n * fact(n - 1)

    assert fact(5) == 120


def test_capture_trace_cpu(tmp_path: Path) -> None:
    a = torch.randn(32, 32)
    calls = []

    @nvtx_range("dsv4cp/decorated")
    def step() -> None:
        calls.append(1)
        with nvtx_range("dsv4cp/layer0/gather"):
            b = a @ a
        with nvtx_range("dsv4cp/layer0/prepare"), nvtx_range("dsv4cp/layer0/prepare/q"):
            b.relu()

    path = tmp_path / "cpu_trace.json"
    tr = capture_trace(step, path=path, warmup=2, activities=[torch.profiler.ProfilerActivity.CPU])
    assert len(calls) == 3
    assert path.stat().st_size > 0
    again = Trace.load(path)
    names = set(again.range_names("dsv4cp/"))
    assert {
        "dsv4cp/decorated",
        "dsv4cp/layer0/gather",
        "dsv4cp/layer0/prepare",
        "dsv4cp/layer0/prepare/q",
    } <= names
    assert set(tr.range_names("dsv4cp/")) == names
    if not torch.cuda.is_available():
        assert tr.kernels() == [] and tr.streams() == []
        assert overlap_fraction(tr.kernels()) == 0.0
    gz = tmp_path / "cpu_trace.json.gz"
    tr_gz = capture_trace(
        step, path=gz, warmup=0, iters=2, activities=[torch.profiler.ProfilerActivity.CPU]
    )
    assert len(tr_gz.ranges("dsv4cp/layer0/gather")) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_capture_trace_cuda_two_streams(tmp_path: Path) -> None:
    a = torch.randn(2048, 2048, device="cuda")
    side = torch.cuda.Stream()

    def step() -> None:
        with nvtx_range("t/prepare"):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(4):
                    a @ a
            for _ in range(4):
                a @ a
            torch.cuda.current_stream().wait_stream(side)

    tr = capture_trace(step, path=tmp_path / "gpu.json", warmup=2)
    ks = tr.kernels_in("t/prepare")
    assert len({k.stream for k in ks}) == 2
    assert 0.0 <= overlap_fraction(ks) <= 1.0
    plot_timeline(ks, tmp_path / "gpu.png", title="two streams")
