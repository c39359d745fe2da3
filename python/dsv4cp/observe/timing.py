"""Where time goes, per named stage: `stage(name)` is the one instrumentation call of the model.

`with stage("q_chain"):` pushes an NVTX range (on CUDA, unless DSV4CP_NVTX=0) and, while a torch
profiler records, a `record_function` range; and when a `StageTimer` is current (`use_timer`,
set by `PrefillRunner.prefill(timer=...)`), it adds the stage's host wall time to that timer.
The timer synchronises CUDA around each stage, so it is only used on eager forwards. NVTX ranges
are host-side: they appear where Python runs (eager, warm-up, capture), not for the kernels of a
replayed CUDA graph.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ContextDecorator, contextmanager
from contextvars import ContextVar
from functools import cache
from typing import Any

import torch

from dsv4cp import env_vars

__all__ = ["StageTimer", "nvtx_range", "stage", "use_timer"]


@cache
def _nvtx_on() -> bool:
    if not env_vars.read("DSV4CP_NVTX"):
        return False
    return torch.cuda.is_available()


def _profiler_on() -> bool:
    return bool(torch._C._autograd._profiler_enabled())


class nvtx_range(ContextDecorator):
    """`with nvtx_range("layer3/gather"):` pushes an NVTX range on CUDA (unless DSV4CP_NVTX=0) and,
    while a torch profiler is recording, a `record_function` range so CPU traces show the name.
    With neither active it only does two flag checks. Also usable as a decorator."""

    __slots__ = ("_nvtx", "_rf", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._nvtx = False
        self._rf: Any = None

    def __enter__(self) -> nvtx_range:
        if _profiler_on():
            self._rf = torch.profiler.record_function(self.name)
            self._rf.__enter__()
        if _nvtx_on():
            torch.cuda.nvtx.range_push(self.name)
            self._nvtx = True
        return self

    def _recreate_cm(self) -> nvtx_range:
        return nvtx_range(self.name)  # fresh state per decorated call (recursion, threads)

    def __exit__(self, *exc: object) -> None:
        if self._nvtx:
            torch.cuda.nvtx.range_pop()
            self._nvtx = False
        if self._rf is not None:
            rf, self._rf = self._rf, None
            rf.__exit__(*exc)


class StageTimer:
    """Host wall time per stage name (synchronises CUDA around each stage)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.total: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.total[name] += time.perf_counter() - t0
            self.count[name] += 1

    def rows(self) -> list[tuple[str, float, int]]:
        """(stage, total ms, calls), largest first."""
        return sorted(
            ((k, v * 1e3, self.count[k]) for k, v in self.total.items()), key=lambda r: -r[1]
        )


_TIMER: ContextVar[StageTimer | None] = ContextVar("dsv4cp_stage_timer", default=None)


@contextmanager
def use_timer(timer: StageTimer | None) -> Iterator[None]:
    """Make `timer` the current stage timer of this thread's context (None: no timing)."""
    token = _TIMER.set(timer)
    try:
        yield
    finally:
        _TIMER.reset(token)


@contextmanager
def stage(name: str, *, layer: int | None = None, timed: bool = True) -> Iterator[None]:
    """An NVTX range named `name` (`layer{layer}/{name}` with a layer) and, when `timed` and a
    timer is current, the stage's host time under `name`. `timed=False` is for ranges that
    enclose timed stages (a layer), which the timer would otherwise count twice."""
    timer = _TIMER.get() if timed else None
    with nvtx_range(name if layer is None else f"layer{layer}/{name}"):
        if timer is None:
            yield
        else:
            with timer.stage(name):
                yield
