"""Every CLI input error is a clear message and a non-zero exit, never a traceback (issue 16,
item 6: the probe's part 1 cases), checked before any work starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4cp.cli import main

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="the case is a machine without GPU")

# (argv, what stderr's last line says); argparse errors and UsageErrors both exit 2.
CASES = [
    (["check", "--cp", "100000"], "cp_size 100000 is more than the gloo backend can run here"),
    (["check", "--cp", "100000", "--cp-backend", "fake"], "at most 64: fake CP runs one thread"),
    (["check", "--lens", "5,,7"], "argument --lens: empty item in '5,,7'"),
    (["check", "--lens", "5,"], "argument --lens: empty item in '5,'"),
    (["check", "--lens", "0"], "argument --lens: expected positive integers, got 0"),
    (["check", "--lens", "-5"], "argument --lens: expected positive integers, got -5"),
    (["check", "--tol", "-1"], "argument --tol: expected a finite number >= 0.0, got -1.0"),
    (["check", "--tol", "nan"], "argument --tol: expected a finite number >= 0.0, got nan"),
    (["check", "--tol", "inf"], "argument --tol: expected a finite number >= 0.0, got inf"),
    (["check", "--cp-backend", "nccl"], "--cp-backend nccl needs --device cuda"),
    (["check", "--timeout", "0"], "argument --timeout: expected a finite number > 0.0"),
    (["check", "--timeout", "-1", "--cp-backend", "fake"], "argument --timeout: expected a"),
    (["check", "--timeout", "nan"], "argument --timeout: expected a finite number > 0.0"),
    (["check", "--seed", str(10**23)], "argument --seed: expected a seed in [0, 2**32)"),
    (["check", "--seed", "-7"], "argument --seed: expected a seed in [0, 2**32), got -7"),
    (["check", "--lens", "100000", "--cp-backend", "fake"], "too large for the CPU reference"),
    (["check", "--lens", "9000,9000"], "use --device cuda, shorter prompts, or --allow-large"),
    (["check", "--lens", "5", "--prefix", "5"], "prefix 5 must be in [0, 5)"),
    (["check", "--chunk", "-3"], "chunk must be >= 0"),
    (["check", "--multistream"], "--multistream and --graphs need --device cuda"),
    (["check", "--quant", "qat", "--lens", "7"], "--quant qat needs a released-format checkpoint"),
    (["demo", "--quant", "qat", "--lens", "7"], "give --checkpoint DIR, or --quant none"),
    (["demo", "--timeout", "0"], "argument --timeout: expected a finite number > 0.0"),
    (["demo", "--cp-backend", "nccl"], "--cp-backend nccl needs --device cuda"),
    (["demo", "--lens", "30", "--prefix", "0,1"], "--prefix needs one value per length"),
    (["demo", "--graphs"], "--multistream and --graphs need --device cuda"),
    (
        ["reference-check", "--checkpoint", "x", "--reference", "y", "--chunk", "-1"],
        "reference-check: chunk must be >= 0 (0: one chunk), got -1",
    ),
    (["profile", "--lens", "0"], "argument --lens: expected positive integers, got 0"),
    (["profile", "--lens", "-4"], "argument --lens: expected positive integers, got -4"),
    (["profile", "--lens", "20000"], "too large for the CPU reference"),
    (["profile", "--graphs"], "--multistream and --graphs need --device cuda"),
    (["profile", "--lens", "4", "--out", "/proc/dsv4cp-x"], "/proc/dsv4cp-x: cannot create"),
    (["export-tiny", "/proc/dsv4cp-x"], "/proc/dsv4cp-x: cannot create the directory"),
    (["export-tiny", "/tmp", "--seed", str(2**128)], "argument --seed: expected a seed in"),
    (
        ["accuracy", "--base-url", "http://127.0.0.1:1", "--model-path", "/nonexistent"],
        "/nonexistent",
    ),
]
GPU_CASES = [
    (["check", "--device", "cuda"], "--device cuda: no CUDA device is available"),
    (["check", "--device", "cuda", "--cp-backend", "fake"], "--device cuda: no CUDA device"),
    (["demo", "--device", "cuda"], "--device cuda: no CUDA device is available"),
    (["profile", "--device", "cuda"], "--device cuda: no CUDA device is available"),
    (
        ["reference-check", "--checkpoint", "x", "--reference", "y", "--device", "cuda"],
        "--device cuda: no CUDA device is available",
    ),
]


def _exit(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse
        return int(e.code or 0)


def _one_error(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    rc = _exit(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"dsv4cp {argv[0]}: ") and message in last, last


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_input_error_is_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    _one_error(argv, message, capsys)


@NO_GPU
@pytest.mark.parametrize("argv,message", GPU_CASES, ids=[" ".join(a) for a, _ in GPU_CASES])
def test_absent_gpu_is_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    _one_error(argv, message, capsys)


@pytest.mark.parametrize("target", ["file", "file/sub"])
def test_outputs_that_are_files(target: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "file").write_text("x")
    out = str(tmp_path / target)
    for argv in (["export-tiny", out], ["profile", "--lens", "4", "--out", out]):
        want = "exists and is not a directory" if target == "file" else "cannot create"
        _one_error(argv, want, capsys)


def test_export_refuses_a_directory_holding_another_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (d / "model-00001-of-00002.safetensors").write_bytes(b"x")
    (d / "README.md").write_text("kept")
    _one_error(["export-tiny", str(d)], "holds another checkpoint's weights", capsys)
    assert (d / "model.safetensors.index.json").exists()
    assert main(["export-tiny", str(d), "--force"]) == 0
    out = capsys.readouterr().out
    assert "removed" in out and "model.safetensors.index.json" in out
    assert sorted(p.name for p in d.glob("*.safetensors*")) == ["model.safetensors"]
    assert (d / "README.md").read_text() == "kept"
    assert main(["export-tiny", str(d)]) == 0  # its own files are overwritten, as before
    assert json.loads((d / "config.json").read_text())["model_type"]


def test_export_counts_dangling_weight_links_as_another_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A `*.safetensors` link that leads nowhere (dangling, or a loop) was left in place, exit 0:
    a loader's glob finds it and fails on it. It is refused, and --force removes the link."""
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "model-00001-of-00002.safetensors").symlink_to(tmp_path / "gone.safetensors")
    (d / "loop.safetensors").symlink_to(d / "loop.safetensors")
    want = "holds another checkpoint's weights (loop.safetensors, model-00001-of-00002"
    _one_error(["export-tiny", str(d)], want, capsys)
    assert main(["export-tiny", str(d), "--force"]) == 0
    assert sorted(p.name for p in d.iterdir() if p.name.endswith(".safetensors")) == [
        "model.safetensors"
    ]


def test_export_files_have_one_mode(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """model.safetensors was written 0600 (safetensors' own mode) beside 0644 config and
    tokenizer files: a server running as another user could not read the weights. Every
    exported file now has the mode a file created here gets (0666 less the umask)."""
    umask = os.umask(0o022)
    try:
        d = tmp_path / "out"
        assert main(["export-tiny", str(d)]) == 0
    finally:
        os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in d.iterdir()}
    assert modes and set(modes.values()) == {0o644}, modes


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "model.safetensors"])
def test_export_refuses_an_output_path_that_is_a_directory(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # Before: a traceback after config.json and the weights were written (tokenizer.json), or
    # an IsADirectoryError (config.json). Now refused up front, nothing written, --force or not.
    d = tmp_path / "ckpt"
    (d / name).mkdir(parents=True)
    for force in ([], ["--force"]):
        _one_error(["export-tiny", str(d), *force], f"{name} is in the way (not a file)", capsys)
        assert [p.name for p in d.iterdir()] == [name]


def test_export_that_fails_while_writing_leaves_the_directory_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dsv4cp.tools import export_tiny as mod

    d = tmp_path / "ckpt"
    mod.export_tiny(d, seed=1)
    before = {p.name: p.read_bytes() for p in d.iterdir()}

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mod, "write_tokenizer", broken)
    with pytest.raises(OSError, match="No space left"):
        mod.export_tiny(d, seed=2)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before  # no scratch dir left either
    empty = tmp_path / "empty"
    with pytest.raises(OSError, match="No space left"):
        mod.export_tiny(empty, seed=2)
    assert list(empty.iterdir()) == []


def test_demo_lens_alone_does_not_blame_the_default_prefix(capsys: pytest.CaptureFixture) -> None:
    argv = ["demo", "--cp", "2", "--cp-backend", "fake", "--lens", "30", "--chunk", "0"]
    assert main(argv) == 0
    assert "PASS" in capsys.readouterr().out


def test_failed_cp_run_is_reported_without_a_traceback() -> None:
    # A 1 ms collective timeout: the gloo ranks cannot even connect; the launcher's summary is
    # printed (not a Python traceback) and the exit status is 1.
    proc = subprocess.run(
        [sys.executable, "-m", "dsv4cp", "check", "--cp", "2", "--lens", "5", "--timeout", "0.001"],
        env={**os.environ, "PYTHONPATH": str(ROOT / "python")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "dsv4cp check: CP launch failed (backend gloo, cp_size 2, timeout 0.001s)" in proc.stderr


def test_debug_cp_prints_the_ranks_tracebacks() -> None:
    # The same failure with --debug-cp: the summary, then each rank's traceback (as with
    # DSV4CP_DEBUG_CP=1); the flag reaches the spawned ranks through the environment.
    env = {k: v for k, v in os.environ.items() if k != "DSV4CP_DEBUG_CP"}
    argv = ["check", "--cp", "2", "--lens", "5", "--timeout", "0.001", "--debug-cp"]
    proc = subprocess.run(
        [sys.executable, "-m", "dsv4cp", *argv],
        env={**env, "PYTHONPATH": str(ROOT / "python")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "dsv4cp check: CP launch failed (backend gloo, cp_size 2" in proc.stderr
    assert "--- traceback of rank" in proc.stderr


def test_entry_point_exits_with_mains_status(monkeypatch: pytest.MonkeyPatch) -> None:
    """`dsv4cp` (cli.run) exits with main's status; without CUDA work through sys.exit."""
    from dsv4cp.cli import run

    monkeypatch.setenv("DSV4CP_CLEAN_EXIT", "")
    with pytest.raises(SystemExit) as e:
        run(["cache-size", "--tokens", "-3"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        run(["cache-size", "--config", "tiny", "--tokens", "64"])
    assert e.value.code == 0


def _fixture_copy(tmp_path: Path) -> Path:
    import shutil

    from tests.checkpoint.corrupt import FIXTURE

    return Path(shutil.copytree(FIXTURE, tmp_path / "ckpt"))


@pytest.mark.parametrize("command", ["check", "demo"])
def test_checkpoint_that_fails_to_load_is_one_line(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A CheckpointError from the loader (here a missing shard) is bad input: one line, exit 2
    (it was a traceback: the weights load after the argument checks)."""
    from tests.checkpoint.corrupt import shard_of

    d = _fixture_copy(tmp_path)
    shard_of(d, "norm.weight").unlink()
    _one_error([command, "--checkpoint", str(d)], "shard file is missing", capsys)


@pytest.mark.parametrize("quant", ["none", "qat"])
def test_checkpoint_given_a_dsv4cp_export_says_so(
    quant: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """An export-tiny directory as --checkpoint: named as an export before any weight is read
    (it was a traceback: 33 missing `.scale` tensors, or NotImplementedError with qat)."""
    d = tmp_path / "export"
    assert main(["export-tiny", str(d)]) == 0
    capsys.readouterr()
    for command in ("check", "demo"):
        argv = [command, "--checkpoint", str(d), "--quant", quant]
        _one_error(argv, f"{d} is a dsv4cp export", capsys)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
@pytest.mark.parametrize("command", ["check", "demo", "reference-check"])
def test_checkpoint_given_as_a_file_is_named_as_such(
    command: str, name: str, capsys: pytest.CaptureFixture
) -> None:
    """--checkpoint naming a file of the checkpoint (its index, its config.json): said to be
    not a directory (the index was read as a config and blamed for lacking 18 fields or a
    model_type, config.json was read as an index and blamed for lacking a weight_map)."""
    from tests.checkpoint.corrupt import FIXTURE

    path = FIXTURE / name
    argv = [command, "--checkpoint", str(path)]
    if command == "reference-check":
        argv += ["--reference", str(FIXTURE.parent / "reference_outputs.safetensors")]
    _one_error(
        argv, f"{path}: not a directory; a released-format checkpoint is a directory", capsys
    )


def test_sigterm_runs_the_cleanup_and_exits_143(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """SIGTERM while export-tiny writes into its scratch directory: `terminated`, status 143,
    the scratch directory removed (SIGTERM's default action ended the process at once and left
    `.export-tiny-*` behind), and SIGTERM's default action restored after."""
    import signal
    import time

    from dsv4cp.tools import export_tiny

    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        pytest.skip("SIGTERM has a handler in this process; main leaves it alone")
    write = export_tiny.write_tokenizer

    def write_then_terminate(*args: object, **kwargs: object) -> object:
        out = write(*args, **kwargs)  # type: ignore[arg-type]
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, "would end pytest"
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises in here
        return out

    monkeypatch.setattr(export_tiny, "write_tokenizer", write_then_terminate)
    d = tmp_path / "out"
    assert main(["export-tiny", str(d)]) == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == "terminated"
    assert list(d.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.parametrize(
    "var,value,message",
    [
        ("DSV4CP_KEEP_BF16_WEIGHTS", "bogus", "DSV4CP_KEEP_BF16_WEIGHTS must be one of"),
        ("DSV4CP_CHECK_FINITE", "maybe", "DSV4CP_CHECK_FINITE must be 1 or 0"),
    ],
)
@pytest.mark.parametrize("command", ["check", "profile"])
def test_bad_environment_variable_is_one_line(
    command: str,
    var: str,
    value: str,
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    """A bad DSV4CP_* value the model build or the checkpoint load reads: one line, exit 2,
    before any work (it was a ValueError traceback once the run had started; the start-up check
    is `env_vars.check_environment`, tests/test_env_vars.py)."""
    monkeypatch.setenv(var, value)
    _one_error([command, "--lens", "4"], message, capsys)
