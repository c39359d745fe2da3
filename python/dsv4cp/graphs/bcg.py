"""Breakable CUDA graphs: a forward captured as CUDA-graph segments separated by eager breaks.

`BreakableGraph.capture(fn)` runs `fn` on a capture stream (given, or a `side_stream` that no
other live owner holds: fake CP ranks capture concurrently); inside it, `eager_break(fn, *args)`
ends the current segment, runs `fn(*args)` eagerly, keeps its output as a bridge buffer and
begins the next segment (a segment left empty, e.g. by two breaks in a row, is not replayed).
`replay()` replays segment 0, re-runs break 0 and copies its fresh result into the bridge
buffer, replays segment 1, and so on. All segments share one memory pool (several graphs,
e.g. one per token bucket, can share it too). Outside a capture `eager_break` just calls `fn`.

Breaks exist only where a non-capturable collective is needed (FakeCPGroup's cross-thread
gathers, put behind breaks by `graphs.runner.EagerBreakCPGroup`); NCCL gathers and everything
else — indexer and compressor included — are captured. A break inside an open fork/join region
would silently lose side-stream work at replay, so `eager_break` raises there
(docs/invariants.md, invariant 4).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dsv4cp.executors import open_fork_lanes
from dsv4cp.side_streams import side_stream

_state = threading.local()
_warnings_lock = threading.Lock()  # catch_warnings swaps global state; fake CP ranks are threads


class GraphBreakError(RuntimeError):
    pass


def current_capture() -> BreakableGraph | None:
    return getattr(_state, "graph", None)


def in_capture() -> bool:
    return current_capture() is not None


@dataclass
class _Break:
    fn: Callable[..., Tensor]
    args: tuple[Any, ...]
    out: Tensor


@dataclass
class BreakableGraph:
    pool: Any = None  # torch.cuda graph pool handle; None = a private pool for this graph
    stream: torch.cuda.Stream | None = None
    segments: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    breaks: list[_Break] = field(default_factory=list)
    empty: set[int] = field(default_factory=set)  # segments with no work: not replayed
    output: Any = None

    def _begin(self) -> None:
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        self.segments.append(g)

    def _end(self) -> None:
        # A segment with no work (two breaks in a row, or a break that ends the forward) is
        # empty; torch warns about it at capture_end. It is kept for the break order, not
        # replayed, and that warning is not passed on; any other warning is.
        with _warnings_lock, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.segments[-1].capture_end()
        for w in caught:
            if "CUDA Graph is empty" in str(w.message):
                self.empty.add(len(self.segments) - 1)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if self.pool is None:
            self.pool = self.segments[-1].pool()

    def _abort(self) -> None:
        """End a capture that raised, so the process (its RNG, its streams) stays usable."""
        seg = self.segments[-1] if self.segments else None
        if seg is not None and torch.cuda.is_current_stream_capturing():
            try:
                seg.capture_end()
            except RuntimeError:
                pass
        self.segments.clear()
        self.breaks.clear()
        self.empty.clear()

    def capture(self, fn: Callable[[], Any]) -> Any:
        if in_capture():
            raise GraphBreakError("nested BreakableGraph capture")
        stream = self.stream = self.stream or side_stream(owner=self)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _state.graph = self
            try:
                self._begin()
                self.output = fn()
                self._end()
            except BaseException:
                self._abort()
                raise
            finally:
                _state.graph = None
        torch.cuda.current_stream().wait_stream(stream)
        return self.output

    def replay(self) -> Any:
        stream = self.stream
        if stream is None:
            raise GraphBreakError("BreakableGraph.replay before capture")
        main = torch.cuda.current_stream()
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            for i, seg in enumerate(self.segments):
                if i not in self.empty:
                    seg.replay()
                if i < len(self.breaks):
                    b = self.breaks[i]
                    b.out.copy_(b.fn(*b.args))
        main.wait_stream(stream)
        return self.output

    @property
    def num_segments(self) -> int:
        return len(self.segments)


def eager_break(fn: Callable[..., Tensor], *args: Any) -> Tensor:
    """Run fn(*args) outside the graph (at capture and at every replay); returns a bridge tensor."""
    graph = current_capture()
    if graph is None:
        return fn(*args)
    lanes = open_fork_lanes()
    if lanes:
        raise GraphBreakError(
            f"eager break inside an open fork/join region (lanes {lanes}); move the break "
            "before the fork or after the join"
        )
    graph._end()
    out = fn(*args)
    graph.breaks.append(_Break(fn, args, out))
    graph._begin()
    return out
