"""Tie a spawned rank's life to its parent's, and read a child's run state.

`die_with_parent(parent_pid)` runs first in every rank process: on Linux the kernel sends it
SIGKILL when the parent dies (`prctl(PR_SET_PDEATHSIG)`); a daemon thread also polls
`os.getppid()` (every platform, and the case where the parent died before the prctl). So a
parent killed by SIGKILL, SIGTERM or a crash leaves no rank behind. (Linux sends the signal when
the *thread* that started the rank ends: `spawn_ranks` starts ranks from the thread that then
waits for them, which outlives them.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

__all__ = ["POLL_S", "die_with_parent", "process_state"]

POLL_S = 0.5  # how often the watchdog thread looks at the parent pid
_PR_SET_PDEATHSIG = 1


def _set_pdeathsig() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent_pid: int) -> None:
    while True:
        time.sleep(POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)  # the parent is gone: nobody reads this rank's result


def die_with_parent(parent_pid: int) -> None:
    """Exit at once if `parent_pid` is no longer this process's parent, and make sure this
    process dies (SIGKILL on Linux, else within `POLL_S`) when it stops being so."""
    _set_pdeathsig()
    if os.getppid() != parent_pid:  # it died before the prctl took effect
        os._exit(1)
    t = threading.Thread(target=_watch, args=(parent_pid,), name="dsv4cp-parent-watch", daemon=True)
    t.start()


def process_state(pid: int) -> str | None:
    """The run state letter of `pid` from /proc (R, S, D, T = stopped, Z, …); None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # "pid (comm) S ...": comm may hold spaces and parentheses; the state follows the last ')'.
    rest = text.rsplit(")", 1)[-1].split()
    return rest[0] if rest else None
