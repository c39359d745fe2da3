"""Start CP ranks as local processes (gloo on CPU, NCCL on GPU) or as threads (fake).

`spawn_ranks(cp, fn, args)` runs fn(group, *args) in `cp` spawned processes and returns their
results in rank order. The parent owns the rendezvous `TCPStore` (bound to a free localhost
port by the OS, so there is no port race) and one pipe per rank, which it reads as reports
arrive (a rank never blocks on a result nobody reads: if the parent is gone its write fails and
it exits). Ranks die with the parent (`cp/lifeline.py`). When a rank dies or raises, the parent
collects the others' errors for `failure_grace_s` (at most `TIMEOUT_GRACE_S` after a collective
timed out: the ranks that have not reported by then are hung), kills whoever is left and raises
`CPLaunchError` naming every rank's fate. Nothing waits forever: the children's process group
has `timeout=timedelta(seconds=timeout_s)`. docs/cp.md, "Failure behaviour", says what a user
sees.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv4cp.cp.dist import TorchDistCPGroup
from dsv4cp.cp.fake import FakeCPWorld, run_ranks
from dsv4cp.cp.group import CPCommError, CPTimeoutError, SingleCPGroup, check_cp_size
from dsv4cp.cp.guard import resolve_check_order
from dsv4cp.cp.lifeline import die_with_parent, process_state
from dsv4cp.cp.limits import check_cp_limit

__all__ = ["TIMEOUT_GRACE_S", "CPLaunchError", "run_cp", "spawn_ranks"]

_HOST = "127.0.0.1"
_POLL_S = 0.05
_STORE_MIN_TIMEOUT_S = 30.0  # the parent's store only connects to itself; nothing waits on it
# After a collective timed out, every healthy rank times out in the same collective within the
# skew of their arrival: a rank with no report this long after the first timeout is hung.
TIMEOUT_GRACE_S = 1.0


class CPLaunchError(RuntimeError):
    """A spawned CP rank died, hung, raised, or did not finish in time.

    `rank`: the rank blamed first (one that died, else the first to raise on its own, else one
    still silent after the others' collectives timed out, else the first whose collective
    failed, else one the launcher killed);
    `failures`: rank → one-line description for every rank that did not return a result;
    `tracebacks`: rank → the traceback text a rank sent back."""

    def __init__(
        self, message: str, *, rank: int, failures: dict[int, str], tracebacks: dict[int, str]
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.failures = failures
        self.tracebacks = tracebacks

    def summary(self) -> str:
        """The message without the ranks' tracebacks."""
        return str(self).split("\n--- traceback of rank", 1)[0]


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (list, tuple)):
        items = [_to_cpu(o) for o in obj]
        return type(obj)(items) if type(obj) in (list, tuple) else obj
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def _rank_main(
    rank: int,
    cp_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    check_order: bool,
    fn: Callable[..., Any],
    args: tuple,
    conn: Connection,
    env: dict[str, str],
    num_threads: int | None,
    parent_pid: int,
) -> None:
    die_with_parent(parent_pid)
    code = 0
    try:
        os.environ.update(env)
        if num_threads:
            torch.set_num_threads(num_threads)
        td = timedelta(seconds=timeout_s)
        store = dist.TCPStore(_HOST, port, cp_size, is_master=False, timeout=td)
        kw: dict[str, Any] = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kw["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=cp_size, timeout=td, **kw
        )
        group = TorchDistCPGroup(None, timeout_s=timeout_s, check_order=check_order)
        report = pickle.dumps(("ok", rank, _to_cpu(fn(group, *args))))
    except BaseException as e:  # noqa: BLE001 - everything is reported to the parent
        code = 1
        exc_bytes: bytes | None = None
        try:
            data = pickle.dumps(e)
            pickle.loads(data)
            exc_bytes = data
        except Exception:
            pass
        secondary = isinstance(e, CPCommError)  # a collective failed: maybe a peer's fault
        timed_out = isinstance(e, CPTimeoutError)
        text = f"{type(e).__name__}: {e}"
        tb = traceback.format_exc()
        report = pickle.dumps(("err", rank, text, tb, exc_bytes, secondary, timed_out))
    # Blocks only while the parent reads; if the parent is gone the write fails at once.
    with contextlib.suppress(OSError):
        conn.send_bytes(report)
        conn.close()
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    # The report is sent: skip the interpreter teardown (about 2 s with torch loaded).
    os._exit(code)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def spawn_ranks(
    cp_size: int,
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    *,
    backend: str = "gloo",
    timeout_s: float = 60.0,
    check_order: bool | None = None,
    failure_grace_s: float = 5.0,
    deadline_s: float | None = None,
    env: dict[str, str] | None = None,
    num_threads: int | None = None,
) -> list[Any]:
    """Run fn(group, *args) on `cp_size` spawned processes; return the results in rank order.

    fn must be a picklable top-level function; results must be picklable (tensors come back
    on CPU). `timeout_s` is every collective's timeout (process group and TorchDistCPGroup).
    `check_order` None → on iff DSV4CP_DEBUG_CP=1. After the first failure the parent waits
    at most `failure_grace_s` (`TIMEOUT_GRACE_S` after a timeout) for the other ranks' reports,
    then kills them. `deadline_s` bounds the whole run (None: no bound beyond the collective
    timeout). `env` is applied in each child before the process group starts; `num_threads`
    (default cpu_count // cp_size) is each child's torch thread count. cp_size is bounded by
    `cp.limits` (NCCL: one visible GPU per rank). The ranks die with this process.
    """
    check_cp_size(cp_size, who="spawn_ranks")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"spawn_ranks: backend must be 'gloo' or 'nccl', got {backend!r}")
    check_cp_limit(cp_size, backend, who="spawn_ranks")
    if not timeout_s > 0:
        raise ValueError(f"spawn_ranks: timeout_s must be > 0, got {timeout_s!r}")
    args = tuple(args)
    try:
        pickle.dumps(fn)
    except Exception as e:
        raise TypeError(
            f"spawn_ranks: fn must be a picklable top-level function, got {fn!r} "
            f"({type(e).__name__}: {e})"
        ) from e
    try:
        pickle.dumps(args)
    except Exception as e:
        raise TypeError(f"spawn_ranks: args must be picklable ({type(e).__name__}: {e})") from e
    if num_threads is None:
        num_threads = max(1, (os.cpu_count() or 1) // cp_size)

    ctx = mp.get_context("spawn")
    store = dist.TCPStore(
        _HOST,
        0,
        cp_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=max(timeout_s, _STORE_MIN_TIMEOUT_S)),  # its own connect
    )
    flag = resolve_check_order(check_order)
    started: list[Any] = []
    readers: list[Connection] = []
    finished = False
    try:
        for r in range(cp_size):
            reader, writer = ctx.Pipe(duplex=False)
            readers.append(reader)
            proc = ctx.Process(
                target=_rank_main,
                args=(
                    r,
                    cp_size,
                    store.port,
                    backend,
                    float(timeout_s),
                    flag,
                    fn,
                    args,
                    writer,
                    dict(env or {}),
                    num_threads,
                    os.getpid(),
                ),
                name=f"dsv4cp-cp-rank{r}",
                daemon=True,
            )
            try:
                _start_without_sigint(proc, started)
            finally:
                writer.close()  # the child holds its own end: EOF here means it is gone
        reports = _collect(started, readers, failure_grace_s, deadline_s)
        finished = True
    finally:
        _stop(started, grace_s=2.0 if finished else 0.0)
        for reader in readers:
            reader.close()
        del store
    return _finish(reports, backend, cp_size, timeout_s)


def _start_without_sigint(proc: Any, started: list[Any]) -> None:
    """Start a rank with SIGINT blocked: the spawned interpreter inherits the signal mask, so a
    Ctrl-C (sent to the whole foreground process group) reaches only this process, whose
    KeyboardInterrupt stops the ranks (`_stop`). Unblocked, every rank still importing torch
    printed its own KeyboardInterrupt traceback.

    Two things undo a plain mask, both seen as a rank's traceback after a Ctrl-C: the first
    spawn starts multiprocessing's resource tracker, which *unblocks* SIGINT in this thread
    after starting it (so rank 0 started with SIGINT open), hence the tracker is started first;
    and a SIGINT taken by another thread of this process (the store's) raises KeyboardInterrupt
    in this one whatever its mask, which inside `start` left the rank without its launch data,
    hence the interrupt is held (`_held_sigint`) until the rank is in `started` (for `_stop`),
    then raised."""
    resource_tracker.ensure_running()
    if not hasattr(signal, "pthread_sigmask"):
        proc.start()
        started.append(proc)
        return
    with _held_sigint():
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        started.append(proc)


@contextlib.contextmanager
def _held_sigint() -> Iterator[None]:
    """SIGINTs that arrive inside the block are recorded, not acted on; on leaving it the
    previous handler is back and one held SIGINT is raised again (a KeyboardInterrupt under
    Python's default handler). Off the main thread, where handlers cannot be set: a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            signal.raise_signal(signal.SIGINT)


def _stop(procs: list[Any], grace_s: float = 2.0) -> None:
    """Join the started ranks for `grace_s` (those that reported are only exiting), kill the
    rest; interrupted (KeyboardInterrupt) or failed in the launcher: grace 0, kill at once."""
    stop = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, stop - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)


def _receive(rank: int, conn: Connection, proc: Any) -> tuple:
    """A rank's report, or a 'died' report when its pipe closed without one."""
    try:
        data = conn.recv_bytes()
    except (EOFError, OSError):
        proc.join(timeout=1.0)  # the pipe closes as the process exits
        return ("died", rank, f"{_exit_text(proc.exitcode)}; see its stderr")
    try:
        report = pickle.loads(data)
    except Exception as e:  # noqa: BLE001 - e.g. a result class the parent cannot import
        text = f"its result could not be unpickled: {type(e).__name__}: {e}"
        return ("err", rank, text, traceback.format_exc(), None, False, False)
    return tuple(report)


def _collect(
    procs: list[Any], readers: list[Connection], grace_s: float, deadline_s: float | None
) -> dict[int, tuple]:
    n = len(procs)
    reports: dict[int, tuple] = {}
    pending = dict(enumerate(readers))  # rank → pipe, until its report came
    start = time.monotonic()
    first_failure: float | None = None
    after_timeout = False
    while len(reports) < n:
        ready = wait(list(pending.values()), timeout=_POLL_S)
        for r in [r for r, conn in pending.items() if conn in ready]:
            rep = reports[r] = _receive(r, pending.pop(r), procs[r])
            if rep[0] != "ok" and first_failure is None:
                first_failure = time.monotonic()
                after_timeout = rep[0] == "err" and bool(rep[6])
        if len(reports) == n:
            break
        now = time.monotonic()
        grace = min(grace_s, TIMEOUT_GRACE_S) if after_timeout else grace_s
        late = first_failure is not None and now - first_failure > grace
        over = deadline_s is not None and now - start > deadline_s
        if after_timeout:  # a stopped rank cannot answer: no need to wait out the grace
            late = late or all(process_state(procs[r].pid) == "T" for r in pending)
        if late or over:
            for r in sorted(pending):
                stopped = process_state(procs[r].pid) == "T"
                if procs[r].is_alive():
                    procs[r].kill()
                reports[r] = _killed(r, grace, deadline_s if over else None, after_timeout, stopped)
            break
    return reports


def _killed(
    r: int, grace: float, deadline_s: float | None, after_timeout: bool, stopped: bool
) -> tuple:
    note = " (the process was stopped, e.g. by SIGSTOP)" if stopped else ""
    if deadline_s is not None:
        why = f"still running at the {deadline_s:g}s deadline"
        return ("killed", r, f"killed by the launcher ({why}){note}")
    if after_timeout and stopped:
        why = "stopped (e.g. by SIGSTOP) when the others' collectives timed out"
        return ("hung", r, f"hung: {why}; killed by the launcher")
    if after_timeout:
        why = f"no report {grace:g}s after the others' collectives timed out"
        return ("hung", r, f"hung: {why}; killed by the launcher")
    return ("killed", r, f"killed by the launcher (no report {grace:g}s after the first failure)")


def _finish(reports: dict[int, tuple], backend: str, cp_size: int, timeout_s: float) -> list:
    if all(reports[r][0] == "ok" for r in range(cp_size)):
        return [reports[r][2] for r in range(cp_size)]
    failures: dict[int, str] = {}
    tracebacks: dict[int, str] = {}
    for r, rep in reports.items():
        if rep[0] == "err":
            failures[r] = f"raised {rep[2]}"
            tracebacks[r] = rep[3]
        elif rep[0] == "died":
            failures[r] = f"died ({rep[2]}) without reporting a result"
        elif rep[0] in ("killed", "hung"):
            failures[r] = rep[2]

    # Blame, in order: a rank that died; one that raised on its own (arrival order); one that
    # hung while the others timed out; one whose collective failed (usually a consequence of a
    # peer's failure); one the launcher killed.
    def blame(r: int) -> int:
        rep = reports[r]
        if rep[0] == "died":
            return 0
        if rep[0] == "err":
            return 3 if rep[5] else 1
        return 2 if rep[0] == "hung" else 4

    arrival = list(reports)
    order = sorted(failures, key=lambda r: (blame(r), arrival.index(r)))
    first = order[0]
    cause: BaseException | None = None
    for r in order:
        if reports[r][0] == "err" and reports[r][4] is not None:
            cause = pickle.loads(reports[r][4])
            break
    lines = [
        f"CP launch failed (backend {backend}, cp_size {cp_size}, timeout {timeout_s:g}s): "
        f"rank {first} {failures[first]}"
    ]
    for r in range(cp_size):
        lines.append(f"  rank {r}: {failures.get(r, 'returned a result')}")
    for r in [r for r in order if r in tracebacks][:2]:
        lines.append(f"--- traceback of rank {r} ---\n{tracebacks[r].rstrip()}")
    err = CPLaunchError("\n".join(lines), rank=first, failures=failures, tracebacks=tracebacks)
    if cause is not None:
        raise err from cause
    raise err


def run_cp(
    cp_size: int,
    fn: Callable[..., Any],
    *args: Any,
    backend: str = "fake",
    timeout_s: float = 60.0,
    check_order: bool | None = None,
) -> list[Any]:
    """fn(group, *args) on every CP rank, whatever the backend; results in rank order.

    cp_size 1 runs in this thread with a `SingleCPGroup`; "fake" uses threads of this
    process (`FakeCPWorld`, order guard on unless check_order is False); "gloo"/"nccl" spawn
    processes (`spawn_ranks`; fn must then be picklable)."""
    if backend not in ("fake", "gloo", "nccl"):
        raise ValueError(f"run_cp: backend must be 'fake', 'gloo' or 'nccl', got {backend!r}")
    check_cp_size(cp_size, who="run_cp")
    if cp_size == 1:
        return [fn(SingleCPGroup(), *args)]
    if backend == "fake":
        order = True if check_order is None else check_order
        world = FakeCPWorld(cp_size, timeout_s=timeout_s, check_order=order)
        return run_ranks(world, fn, *args)
    return spawn_ranks(
        cp_size, fn, args, backend=backend, timeout_s=timeout_s, check_order=check_order
    )
