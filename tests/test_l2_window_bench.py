"""benchmarks/l2_window.py on the CPU: its arguments, the CUDA structs' layout, and its refusal
without a GPU."""

from __future__ import annotations

import ctypes

import pytest
from benchmarks import l2_window as l2


def test_the_window_structs_have_cudas_layout() -> None:
    # cudaAccessPolicyWindow: pointer, size_t, float, two enums (28 bytes, padded to 32); the
    # attribute value is a 64-byte union
    assert ctypes.sizeof(l2._Window) == 32
    assert l2._Window.hit_ratio.offset == 16 and l2._Window.miss_prop.offset == 24
    assert ctypes.sizeof(l2._AttrValue) == 64


def test_without_a_hopper_gpu_it_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    if l2.torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert l2.main([]) == 2
    assert "needs Gluon and a Hopper GPU" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [["--rounds", "0"], ["--iters", "0"], ["--hit-ratio", "0"], ["--hit-ratio", "1.5"],
     ["--hit-ratio", "x"]],
    ids=["rounds", "iters", "ratio-0", "ratio-above-1", "ratio-text"],
)  # fmt: skip
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        l2.main(argv)
    assert exc.value.code == 2
