"""`cp.launch._start_without_sigint`: every rank starts with SIGINT blocked (rank 0 too, whose
start also starts multiprocessing's resource tracker, which unblocks SIGINT in the caller), and
a SIGINT arriving while a rank starts is raised only once the rank is started and recorded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dsv4cp.cp import launch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

MASK_SCRIPT = """
import multiprocessing as mp, sys
from dsv4cp.cp.launch import _start_without_sigint

def report(rank, conn):
    blocked = int(open("/proc/self/status").read().split("SigBlk:")[1].split()[0], 16)
    conn.send((rank, bool(blocked & (1 << 1))))  # SIGINT is signal 2: bit 1

if __name__ == "__main__":
    ctx = mp.get_context("spawn")  # pipes, not a Queue: its lock would start the tracker first
    started, readers = [], []
    for r in range(2):
        reader, writer = ctx.Pipe(duplex=False)
        readers.append(reader)
        _start_without_sigint(ctx.Process(target=report, args=(r, writer)), started)
        writer.close()
    got = [reader.recv() for reader in readers]
    for p in started:
        p.join(timeout=60)
    print(got)
"""


def test_every_rank_starts_with_sigint_blocked(tmp_path: Path) -> None:
    """In a fresh interpreter (no resource tracker yet), as `dsv4cp check --cp N` starts."""
    script = tmp_path / "mask.py"
    script.write_text(MASK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[(0, True), (1, True)]", proc.stdout


def test_a_sigint_during_start_is_raised_once_the_rank_is_recorded() -> None:
    """The Ctrl-C lands on another thread of the launcher (as on the store's), which makes the
    main thread raise whatever its mask; it must not cut `start` short."""
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)  # SIGINT unblocked there
    other.start()
    events: list[str] = []

    class Rank:
        def start(self) -> None:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # the interrupt's handler runs in this thread meanwhile
            events.append("started")

    rank, started = Rank(), []
    # Python's own handler, whatever this process inherited (a background job ignores SIGINT)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            launch._start_without_sigint(rank, started)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, inherited)
        stop.set()
        other.join()
    assert events == ["started"] and started == [rank]
