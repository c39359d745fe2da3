"""benchmarks/profile_stages.by_stage: kernels charged to the innermost enclosing stage."""

from __future__ import annotations

from types import SimpleNamespace as Ev

from benchmarks.profile_stages import by_stage


def _op(name: str, parent: Ev | None, *kernels: tuple[str, float]) -> Ev:
    ks = [Ev(name=k, duration=us) for k, us in kernels]
    return Ev(name=name, is_user_annotation=False, cpu_parent=parent, kernels=ks)


def test_kernels_go_to_the_innermost_stage() -> None:
    outer = Ev(name="attention", is_user_annotation=True, cpu_parent=None, kernels=[])
    inner = Ev(name="q_chain", is_user_annotation=True, cpu_parent=outer, kernels=[])
    mm = _op("aten::mm", inner, ("gemm", 1500.0))
    launch = _op("cuLaunchKernel", _op("aten::mm", inner), ("triton_k", 250.0))
    mul = _op("aten::mul", outer, ("mul", 400.0), ("mul", 100.0))
    stray = _op("aten::copy_", None, ("copy", 50.0))
    got = by_stage([outer, inner, mm, launch, mul, stray], rows=1)
    assert list(got) == ["q_chain", "attention", "-"]  # largest stage first
    assert got["q_chain"][0]["cuda_ms"] == 1.75  # stage total counts every kernel
    assert got["q_chain"][1] == {"op": "aten::mm", "kernel": "gemm", "cuda_ms": 1.5, "calls": 1}
    assert len(got["q_chain"]) == 2  # rows=1: the total and the largest kernel
    assert got["attention"][1]["calls"] == 2 and got["attention"][1]["cuda_ms"] == 0.5
    assert got["-"][0]["cuda_ms"] == 0.05
