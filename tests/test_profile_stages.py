"""benchmarks/profile_stages.by_stage: kernels charged to the innermost enclosing stage."""

from __future__ import annotations

from types import SimpleNamespace as Ev

from benchmarks.profile_stages import by_stage
from torch.autograd import DeviceType

CPU, CUDA = DeviceType.CPU, DeviceType.CUDA


def _cpu(name: str, parent: Ev | None, *kernels: tuple[str, float], stage: bool = False) -> Ev:
    ks = [Ev(name=k, duration=us) for k, us in kernels]
    return Ev(name=name, is_user_annotation=stage, cpu_parent=parent, kernels=ks,
              device_type=CPU, id=id(ks))  # fmt: skip


def _dev(name: str, start: float, end: float, *, stream: int = 7) -> Ev:
    # no link to the launching op (torch 2.11's device events have none)
    return Ev(name=name, is_user_annotation=False, kernels=[], device_type=CUDA, device_index=0,
              device_resource_id=stream, time_range=Ev(start=start, end=end))  # fmt: skip


def test_kernels_go_to_the_innermost_stage() -> None:
    outer = _cpu("attention", None, stage=True)
    inner = _cpu("q_chain", outer, stage=True)
    mm = _cpu("aten::mm", inner, ("gemm", 1500.0))
    launch = _cpu("cuLaunchKernel", _cpu("aten::mm", inner), ("cublas_k", 250.0))
    mul = _cpu("aten::mul", outer, ("mul", 400.0), ("mul", 100.0))
    stray = _cpu("aten::copy_", None, ("copy", 50.0))
    events = [outer, inner, mm, launch, mul, stray]
    # the device side: the stages' ranges, the carried kernels again (skipped: already counted
    # through their op), and Triton launches no op carries
    events += [
        _dev("attention", 0, 100_000),
        _dev("q_chain", 10_000, 40_000),
        _dev("gemm", 12_000, 13_500),
    ]
    events += [_dev("_norm_rope_kernel", 20_000, 20_500), _dev("_scan_kernel", 50_000, 51_000)]
    events += [_dev("_side_kernel", 20_000, 21_000, stream=9), _dev("_late", 200_000, 200_100)]
    events += [_dev("gemm", 30_000, 30_700)]  # a gemm no op carries (another duration): counted
    got = by_stage(events, rows=1)
    assert got["q_chain"][0]["cuda_ms"] == 1.5 + 0.25 + 0.5 + 0.7  # every kernel, once
    assert got["q_chain"][1] == {"op": "aten::mm", "kernel": "gemm", "cuda_ms": 1.5, "calls": 1}
    uncarried = {"op": "(no aten op)", "kernel": "gemm", "cuda_ms": 0.7, "calls": 1}
    assert uncarried in by_stage(events, rows=9)["q_chain"]
    assert len(got["q_chain"]) == 2  # rows=1: the total and the largest kernel
    assert got["attention"][0]["cuda_ms"] == 0.5 + 1.0  # the muls and the scan (no aten op)
    assert got["attention"][1] == {"op": "(no aten op)", "kernel": "_scan_kernel", "cuda_ms": 1.0,
                                   "calls": 1}  # fmt: skip
    # a kernel on another stream, or outside every range, is unstaged
    assert got["-"][0]["cuda_ms"] == 0.05 + 1.0 + 0.1
    assert list(got)[0] == "q_chain"  # largest stage first
