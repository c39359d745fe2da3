"""The ranks of `dsv4cp check --cp 3` (gloo) die with their parent: SIGKILL or SIGTERM of the
parent, while the ranks run `check` or sit in a forward, leaves no process of the run alive 10 s
later."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKER = "DSV4CP_TEST_RUN"
GONE_WITHIN_S = 10.0

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]


def _marked(marker: str) -> dict[int, str]:
    """pid → state letter of every live process whose environment holds the marker."""
    found = {}
    needle = f"{MARKER}={marker}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state = stat.rsplit(")", 1)[-1].split()[0]
        if needle in env.split(b"\0") and state != "Z":
            found[int(entry)] = state
    return found


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _kill_parent_and_wait(parent: subprocess.Popen, sig: signal.Signals, marker: str) -> None:
    os.kill(parent.pid, sig)
    parent.wait(timeout=10)
    t0 = time.monotonic()
    left = _marked(marker)
    while left and time.monotonic() - t0 < GONE_WITHIN_S:
        time.sleep(0.2)
        left = _marked(marker)
    assert not left, f"processes of the run alive {GONE_WITHIN_S:g}s after the parent: {left}"


def _cleanup(parent: subprocess.Popen, marker: str) -> None:
    for pid in _marked(marker):  # only this run's processes, by pid
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if parent.poll() is None:
        parent.kill()
        parent.wait()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_check_cli_parent_death_leaves_no_rank(sig: signal.Signals) -> None:
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER: marker, "PYTHONPATH": str(ROOT / "python")}
    argv = [sys.executable, "-m", "dsv4cp", "check", "--cp", "3", "--lens", "8000"]
    parent = subprocess.Popen(
        argv + ["--chunk", "512"],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 240.0
        ranks: list[int] = []
        while time.monotonic() < deadline and parent.poll() is None:
            ranks = [p for p in _marked(marker) if p != parent.pid]
            # the 3 ranks (and multiprocessing's resource tracker) are up and running
            if len(ranks) >= 4 and sorted(_cpu_seconds(p) for p in ranks)[-3] > 1.0:
                break
            time.sleep(0.1)
        assert parent.poll() is None, "the run ended before the parent could be killed"
        assert len(ranks) >= 4, f"the ranks did not start: {_marked(marker)}"
        _kill_parent_and_wait(parent, sig, marker)
    finally:
        _cleanup(parent, marker)


SCRIPT = """
import sys, time, torch
from pathlib import Path
from dsv4cp.cp.launch import spawn_ranks

def fn(group, folder):
    group.all_gather(torch.zeros(4), tag="layer0/x")
    Path(folder, f"rank{group.rank}").write_text("in the forward")
    time.sleep(4)  # the parent dies meanwhile
    return torch.zeros(1 << 20)  # 4 MB: more than a pipe buffer

if __name__ == "__main__":
    spawn_ranks(3, fn, (sys.argv[1],), timeout_s=60)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_spawn_ranks_parent_death_mid_forward(sig: signal.Signals, tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER: marker, "PYTHONPATH": str(ROOT / "python")}
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    parent = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)], env=env, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 180.0
        while time.monotonic() < deadline and parent.poll() is None:
            if all((tmp_path / f"rank{r}").exists() for r in range(3)):
                break
            time.sleep(0.1)
        assert parent.poll() is None, "the run ended before the parent could be killed"
        _kill_parent_and_wait(parent, sig, marker)
    finally:
        _cleanup(parent, marker)


# The launcher as a terminal starts it: Ctrl-C raises KeyboardInterrupt. A shell that runs the
# suite in the background (`nohup … &`, as CI may) starts it with SIGINT ignored, and Python then
# installs no handler: the interrupt would be lost and the test would hang until its timeout.
INTERRUPT_SCRIPT = """
import signal, sys, time, torch
from pathlib import Path
from dsv4cp.cp.launch import spawn_ranks

signal.signal(signal.SIGINT, signal.default_int_handler)

def fn(group, folder):
    Path(folder, f"rank{group.rank}").write_text("in the forward")
    time.sleep(60)

if __name__ == "__main__":
    try:
        spawn_ranks(2, fn, (sys.argv[1],), timeout_s=60)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
"""


@pytest.mark.parametrize("when", ["starting", "running"])
def test_ctrl_c_reaches_only_the_launcher(when: str, tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the whole process group) while the ranks import torch or run: the
    launcher alone is interrupted and stops the ranks at once; no rank prints a traceback (each
    rank still starting printed its KeyboardInterrupt traceback) and none is left."""
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER: marker, "PYTHONPATH": str(ROOT / "python")}
    script = tmp_path / "run.py"
    script.write_text(INTERRUPT_SCRIPT)
    parent = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)],
        env=env,
        start_new_session=True,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180.0
        while time.monotonic() < deadline and parent.poll() is None:
            ranks = [p for p in _marked(marker) if p != parent.pid]
            running = all((tmp_path / f"rank{r}").exists() for r in range(2))
            if running if when == "running" else len(ranks) >= 2:
                break
            time.sleep(0.05)
        assert parent.poll() is None, "the run ended before it could be interrupted"
        if when == "starting":
            assert not (tmp_path / "rank0").exists(), "the ranks were already running"
        os.killpg(parent.pid, signal.SIGINT)
        _, err = parent.communicate(timeout=20)
        assert parent.returncode == 130, err
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
        assert err.strip() == "interrupted", err
        t0 = time.monotonic()
        while _marked(marker) and time.monotonic() - t0 < GONE_WITHIN_S:
            time.sleep(0.2)
        assert not _marked(marker), f"left after the interrupt: {_marked(marker)}"
    finally:
        _cleanup(parent, marker)
