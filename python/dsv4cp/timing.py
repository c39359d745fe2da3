"""Wall-clock time per named stage (host timer; synchronises CUDA around each stage when on)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class StageTimer:
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


@contextmanager
def maybe_stage(timer: StageTimer | None, name: str) -> Iterator[None]:
    if timer is None:
        yield
    else:
        with timer.stage(name):
            yield
