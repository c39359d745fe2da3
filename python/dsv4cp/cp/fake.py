"""FakeCPGroup: every CP rank simulated by a thread of one process (CPU, or ranks sharing one GPU).

`FakeCPWorld(cp)` makes `cp` handles; `run_ranks(world, fn)` runs fn(group) on one thread per
rank. `all_gather` deposits the tensor, meets the other ranks at a rendezvous (with a timeout:
a rank that never arrives or raised fails the others with an error naming the tag), then
concatenates rank-major. On CUDA the producer records an event that the consumer's stream waits
on. Not capturable in a CUDA graph: under graphs its gathers are eager breaks
(`graphs.runner.EagerBreakCPGroup`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from dsv4cp.cp.group import (
    CPCommError,
    CPRankFailedError,
    CPTimeoutError,
    check_cp_size,
    check_input,
    check_splits,
    check_timeout,
)
from dsv4cp.cp.guard import CollectiveRecord, OrderGuard, resolve_check_order, splits_crc
from dsv4cp.cp.limits import check_cp_limit

__all__ = ["FakeCPGroup", "FakeCPWorld", "run_ranks"]


class _Rendezvous:
    """A reusable barrier whose abort never breaks a generation that already completed
    (threading.Barrier.abort also fails threads that are still waking from the last trip)."""

    def __init__(self, parties: int) -> None:
        self._parties = parties
        self._cond = threading.Condition()
        self._count = 0
        self._generation = 0
        self.broken = False

    def wait(self, timeout: float) -> None:
        """Return when all parties arrived; raise BrokenBarrierError on abort or timeout."""
        with self._cond:
            if self.broken:
                raise threading.BrokenBarrierError
            gen = self._generation
            self._count += 1
            if self._count == self._parties:
                self._count = 0
                self._generation += 1
                self._cond.notify_all()
                return
            self._cond.wait_for(lambda: self._generation != gen or self.broken, timeout)
            if self._generation != gen:
                return
            self.broken = True  # timed out (or aborted): nobody may pass any more
            self._cond.notify_all()
            raise threading.BrokenBarrierError

    def abort(self) -> None:
        with self._cond:
            self.broken = True
            self._cond.notify_all()


class FakeCPWorld:
    """`cp_size` ranks simulated in one process: one `FakeCPGroup` per rank, each driven by
    its own thread (see `run_ranks`).

    all_gather: each rank deposits its tensor in a slot (double-buffered by sequence number),
    waits at a shared barrier with `timeout_s`, checks every rank's record
    (shape and dtype always; tags too with `check_order`), then concatenates rank-major.
    A rank that raises (in `run_ranks`) or never arrives breaks the barrier, so the others fail
    fast with `CPRankFailedError` / `CPTimeoutError` naming the tag, never hang. `cp_size` is
    bounded by `cp.limits` (one thread per rank).

    CUDA: after its deposit the producer records an event on its current stream; consumers make
    their current stream wait on that event (no host sync) and `record_stream` the borrowed
    tensor so the caching allocator cannot reuse its block before their copy ran. Not usable
    under CUDA graph capture (raises). Meant for ranks sharing one device (CPU or one GPU).
    """

    def __init__(
        self, cp_size: int, *, timeout_s: float = 60.0, check_order: bool | None = True
    ) -> None:
        self.cp_size = check_cp_limit(
            check_cp_size(cp_size, who="FakeCPWorld"), "fake", who="FakeCPWorld"
        )
        self.timeout_s = check_timeout(timeout_s)
        self.check_order = resolve_check_order(check_order)
        self.groups: tuple[FakeCPGroup, ...] = tuple(FakeCPGroup(self, r) for r in range(cp_size))
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Fresh barrier, slots and sequence numbers (run_ranks calls it before each run)."""
        with self._lock:
            self._barrier = _Rendezvous(self.cp_size)
            self._slots: list[list[Any]] = [[None] * self.cp_size for _ in range(2)]
            self.failure: tuple[int, BaseException] | None = None
            self._finished: set[int] = set()
            for g in self.groups:
                g.guard.reset()

    def group(self, rank: int) -> FakeCPGroup:
        return self.groups[rank]

    def fail(self, rank: int, exc: BaseException) -> None:
        """Rank `rank` raised: remember the first failure and release everyone waiting."""
        with self._lock:
            if self.failure is None:
                self.failure = (rank, exc)
        self._barrier.abort()

    def finish(self, rank: int) -> None:
        """Rank `rank` returned. Every collective it issued has completed, and no later one
        can, so the barrier is broken: a rank still (or later) waiting fails at once."""
        with self._lock:
            self._finished.add(rank)
        self._barrier.abort()

    def __repr__(self) -> str:
        return f"FakeCPWorld(cp_size={self.cp_size}, timeout_s={self.timeout_s})"


class FakeCPGroup:
    """One rank's handle on a `FakeCPWorld`."""

    capturable = False  # cross-thread exchange: an eager break under CUDA graphs

    def __init__(self, world: FakeCPWorld, rank: int) -> None:
        self.world = world
        self._rank = rank
        self.guard = OrderGuard(rank, world.cp_size)

    @property
    def cp_size(self) -> int:
        return self.world.cp_size

    @property
    def rank(self) -> int:
        return self._rank

    def __repr__(self) -> str:
        return f"FakeCPGroup(rank={self._rank}, cp_size={self.cp_size})"

    def all_gather(self, x: Tensor, *, tag: str) -> Tensor:
        x = check_input(x, tag)
        self._not_capturing(x, tag)
        rec = self.guard.next("all_gather", tag, x)
        slots = self._deposit(rec, x)
        return torch.cat(self._borrow(x, [t for _, t, _ in slots], slots))

    def all_to_all(self, x: Tensor, splits: Sequence[Sequence[int]], *, tag: str) -> Tensor:
        x = check_input(x, tag)
        self._not_capturing(x, tag)
        matrix, _, _ = check_splits(x, splits, self._rank, self.cp_size, tag)
        total = sum(map(sum, matrix))
        rec = self.guard.next(
            "all_to_all", tag, x, shape=(total, *x.shape[1:]), splits=splits_crc(matrix)
        )
        slots = self._deposit(rec, x)  # the guard has checked every rank passed this matrix
        me = self._rank
        parts = []
        for i, (_, t, _) in enumerate(slots):
            start = sum(matrix[i][:me])
            parts.append(t[start : start + matrix[i][me]])
        return torch.cat(self._borrow(x, parts, slots))

    @staticmethod
    def _not_capturing(x: Tensor, tag: str) -> None:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"FakeCPGroup cannot run inside CUDA graph capture ({tag!r})")

    def _deposit(self, rec: CollectiveRecord, x: Tensor) -> list[tuple]:
        """Deposit x (with an event on CUDA), meet the other ranks; their (rec, x, event)."""
        event = None
        if x.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(x.device))
        return self._meet(rec, (rec, x, event))

    def _borrow(self, x: Tensor, parts: list[Tensor], slots: list[tuple]) -> list[Tensor]:
        """The other ranks' tensors (or slices) usable on this rank's current stream: wait on
        their events, move them to x's device; `record_stream` keeps the producers' blocks."""
        stream = torch.cuda.current_stream(x.device) if x.is_cuda else None
        for r, (_, _, ev) in enumerate(slots):
            if r != self._rank and ev is not None:
                if stream is not None:
                    stream.wait_event(ev)  # GPU-side wait, no host sync
                else:
                    ev.synchronize()  # a CPU consumer of a CUDA producer
        out = [t if t.device == x.device else t.to(x.device) for t in parts]
        if stream is not None:
            for r, (_, t, _) in enumerate(slots):
                if r != self._rank and t.device == x.device:
                    t.record_stream(stream)  # the producer may free t once it returns
        return out

    def barrier(self) -> None:
        rec = self.guard.next("barrier", "barrier", None)
        self._meet(rec, (rec, None, None))

    def _meet(self, rec: CollectiveRecord, item: tuple) -> list[tuple]:
        w = self.world
        buf = w._slots[rec.seq % 2]
        buf[self._rank] = item
        if w.cp_size > 1:
            try:
                w._barrier.wait(timeout=w.timeout_s)
            except threading.BrokenBarrierError:
                raise self._broken(rec, buf) from None
        slots = list(buf)
        self.guard.verify([s[0] for s in slots], check_tags=w.check_order)
        return slots

    def _broken(self, rec: CollectiveRecord, buf: Sequence[Any]) -> CPCommError:
        w = self.world
        where = f"CP rank {self._rank}/{w.cp_size} (fake): #{rec.seq} {rec.describe()}"
        with w._lock:
            failure, finished = w.failure, sorted(w._finished - {self._rank})
        if failure is not None and failure[0] != self._rank:
            r, e = failure
            return CPRankFailedError(
                f"{where} abandoned: rank {r} failed with {type(e).__name__}: {e}"
            )
        if finished:
            return CPRankFailedError(f"{where}: rank(s) {finished} returned without issuing it")
        missing = [r for r in range(w.cp_size) if buf[r] is None or buf[r][0].seq != rec.seq]
        return CPTimeoutError(
            f"{where} timed out after {w.timeout_s:g}s; rank(s) {missing or '?'} never arrived"
        )


def run_ranks(
    world: FakeCPWorld,
    fn: Callable[..., Any],
    *args: Any,
    join_timeout_s: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run fn(group, *args, **kwargs) for every rank of `world`, one thread per rank; return
    the results in rank order. The first exception raised (in time) is re-raised with a note
    naming its rank; the others' follow-up errors are dropped. `join_timeout_s` bounds the whole
    run (threads still running then are reported; they are daemons and are left behind)."""
    world.reset()
    n = world.cp_size
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def body(rank: int) -> None:
        try:
            results[rank] = fn(world.groups[rank], *args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors[rank] = e
            world.fail(rank, e)
        else:
            world.finish(rank)

    threads = [
        threading.Thread(target=body, args=(r,), name=f"fake-cp-rank{r}", daemon=True)
        for r in range(n)
    ]
    for t in threads:
        t.start()
    if join_timeout_s is None:
        for t in threads:
            t.join()
    else:
        deadline = time.monotonic() + join_timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    alive = [r for r, t in enumerate(threads) if t.is_alive()]
    if alive:
        world.fail(alive[0], CPTimeoutError("run_ranks join timeout"))
        raise CPTimeoutError(f"run_ranks: rank(s) {alive} still running after {join_timeout_s:g}s")
    failure = world.failure
    if failure is None:
        failure = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
    if failure is not None:
        rank, exc = failure
        if hasattr(exc, "add_note"):  # Python ≥ 3.11
            exc.add_note(f"(raised on fake CP rank {rank} of {n})")
        with contextlib.suppress(AttributeError):
            exc.cp_rank = rank  # type: ignore[attr-defined]
        raise exc
    return results
