"""benchmarks/attention_variants.py on the CPU: its arguments and its refusal without a GPU."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from benchmarks import attention_variants as av

HALVES = Path(__file__).parents[1] / "python/dsv4cp/kernels/attention_gluon_halves.py"


@pytest.mark.parametrize("text", ["qov", "=x.py", "qov=/no/such/file.py"])
def test_a_variant_needs_a_name_and_an_existing_file(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=FILE"):
        av._variant(text)


def test_a_variant_file_loads_as_a_kernels_module() -> None:
    assert av._variant(f"copy={HALVES}") == ("copy", HALVES)
    module = av._load("copy", HALVES)
    assert module.__name__ == "dsv4cp.kernels._variant_copy"
    assert callable(module.sparse_attention_gluon_halves)


def test_a_file_without_the_kernel_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other.py"
    other.write_text("X = 1\n")
    with pytest.raises(SystemExit, match="no sparse_attention_gluon_halves"):
        av._load("other", other)


def test_without_a_hopper_gpu_it_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    if av.torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert av.main([f"--variant=copy={HALVES}"]) == 2
    assert "needs Gluon and a Hopper GPU" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [["--rounds", "0"], ["--iters", "0"], [f"--variant=routed={HALVES}"],
     [f"--variant=a={HALVES}", f"--variant=a={HALVES}"]],
    ids=["rounds", "iters", "reserved-name", "same-name"],
)  # fmt: skip
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        av.main(argv)
    assert exc.value.code == 2
