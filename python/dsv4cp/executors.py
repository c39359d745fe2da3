"""How a layer's prepare `Schedule` runs, chosen once per forward.

- `SerialExecutor`: the nodes in issue order on the current stream (CPU, and the reference);
- `MultistreamExecutor`: each lane on its own CUDA stream (`StreamPool`), forks and joins as
  stream waits, released buffers dropped only after the joins; capturable in CUDA graphs.

`ExecutorFactory.choose(local_rows, graphs=...)` is the one multistream decision: the
`MultistreamPolicy` says whether this forward pays for streams, and `LayerExecutors.for_role`
keeps the layer roles that gain nothing from a fork on the serial executor. The runner and the
SGLang adapter both build their executors here.

`overlap_gathers=False` makes a layer run its gathers-first schedule (the compute-only lanes
forked after the gathers): the graph runner asks for it when gathers are eager graph breaks,
which may not sit inside an open fork (docs/invariants.md, invariant 4). `open_fork_lanes`
tells `graphs.bcg.eager_break` which lanes the multistream executor has open on this thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from dsv4cp.observe.timing import stage
from dsv4cp.policy import MultistreamPolicy
from dsv4cp.roles import LayerRole
from dsv4cp.schedule import (
    DEFAULT,
    Fork,
    Join,
    Node,
    PrepareState,
    Release,
    Schedule,
    ScheduleError,
)
from dsv4cp.side_streams import side_stream

__all__ = [
    "SERIAL",
    "Executor",
    "ExecutorFactory",
    "LayerExecutors",
    "MultistreamExecutor",
    "SerialExecutor",
    "StreamPool",
    "open_fork_lanes",
]

LaneHook = Callable[[str], None]
_forks = threading.local()


def open_fork_lanes() -> list[str]:
    """Lanes the multistream executor has forked and not yet joined (this thread)."""
    return sorted(getattr(_forks, "lanes", set()))


def _run_node(node: Node, state: PrepareState, check: bool) -> None:
    with stage(node.name):
        node.fn(state)
    if check:
        missing = [w for w in node.writes if w not in state]
        if missing:
            raise ScheduleError(f"node {node.name!r} did not write {missing}")


class SerialExecutor:
    """Issue order on the current stream. `check` asserts each node wrote what it declared."""

    def __init__(self, *, overlap_gathers: bool = True) -> None:
        self.overlap_gathers = overlap_gathers

    def run(self, schedule: Schedule, state: PrepareState, *, check: bool = False) -> PrepareState:
        for step in schedule.steps:
            if isinstance(step, Node):
                _run_node(step, state, check)
            elif isinstance(step, Release):
                for name in step.names:
                    state.pop(name, None)
        return state


SERIAL = SerialExecutor()


class StreamPool:
    """Side streams, created once (before any capture), one per lane name; no other live owner
    in this process (another fake CP rank, a graph's capture) holds them (`side_streams`)."""

    def __init__(self, lanes: Iterable[str], device: torch.device) -> None:
        self.device = device
        self.streams = {lane: side_stream(device, owner=self) for lane in lanes if lane != DEFAULT}

    def get(self, lane: str) -> torch.cuda.Stream:
        if lane == DEFAULT:
            return torch.cuda.current_stream(self.device)
        try:
            return self.streams[lane]
        except KeyError:
            raise ScheduleError(f"no stream was created for lane {lane!r}") from None


class MultistreamExecutor:
    """Each lane on its own stream; forks and joins are stream waits (capturable in graphs).

    `lane_hook(lane)` (tests only) runs right after a fork on each forked lane and on the
    default lane: tests inject `torch.cuda._sleep` there to shake out missing dependencies.
    """

    def __init__(
        self,
        streams: StreamPool,
        *,
        lane_hook: LaneHook | None = None,
        overlap_gathers: bool = True,
    ) -> None:
        self.streams = streams
        self.lane_hook = lane_hook
        self.overlap_gathers = overlap_gathers

    def run(self, schedule: Schedule, state: PrepareState) -> PrepareState:
        streams, hook = self.streams, self.lane_hook
        main = torch.cuda.current_stream(streams.device)
        open_lanes: set[str] = getattr(_forks, "lanes", set())
        _forks.lanes = open_lanes
        try:
            for step in schedule.steps:
                if isinstance(step, Fork):
                    for lane in step.lanes:
                        open_lanes.add(lane)
                        s = streams.get(lane)
                        s.wait_stream(main)
                        if hook is not None:
                            with torch.cuda.stream(s):
                                hook(lane)
                    if hook is not None:
                        hook(DEFAULT)
                elif isinstance(step, Join):
                    for lane in step.lanes:
                        main.wait_stream(streams.get(lane))
                        open_lanes.discard(lane)
                elif isinstance(step, Release):
                    for name in step.names:
                        state.pop(name, None)
                elif step.lane == DEFAULT:
                    _run_node(step, state, False)
                else:
                    with torch.cuda.stream(streams.get(step.lane)):
                        _run_node(step, state, False)
        finally:
            for lane in schedule.lanes:
                open_lanes.discard(lane)
        return state


Executor = SerialExecutor | MultistreamExecutor


@dataclass(frozen=True)
class LayerExecutors:
    """The executors of one forward: multistream (when the forward pays for it) for the layer
    roles that gain from a fork, serial for the rest."""

    serial: SerialExecutor = SERIAL
    multistream: MultistreamExecutor | None = None
    policy: MultistreamPolicy | None = None
    local_rows: int = 0  # this forward's rows on this rank

    def for_role(self, role: LayerRole) -> Executor:
        pays = self.policy is None or self.policy.layer_pays(role, self.local_rows)
        if self.multistream is not None and pays:
            return self.multistream
        return self.serial


SERIAL_ONLY = LayerExecutors()


class ExecutorFactory:
    """Owns the stream pool and the policy; `choose` picks one forward's executors."""

    def __init__(
        self,
        policy: MultistreamPolicy,
        streams: StreamPool | None = None,
        *,
        lane_hook: LaneHook | None = None,
    ) -> None:
        self.policy = policy
        self.streams = streams
        self.lane_hook = lane_hook

    @classmethod
    def create(
        cls,
        multistream: bool | str | MultistreamPolicy,
        *,
        device: torch.device,
        lanes: Iterable[str],
    ) -> ExecutorFactory:
        """True/False force the executor; "auto"/"on"/"off" (or DSV4CP_MULTISTREAM under
        "auto") ask the policy per forward. Streams exist only on CUDA, when not forced off."""
        policy = (
            multistream
            if isinstance(multistream, MultistreamPolicy)
            else MultistreamPolicy.of(multistream)
        )
        cuda = device.type == "cuda"
        if policy.mode == "on" and not cuda:
            raise ValueError("multistream needs a CUDA device (CPU runs the serial schedule)")
        streams = StreamPool(lanes, device) if policy.mode != "off" and cuda else None
        return cls(policy, streams)

    def with_lane_hook(self, hook: LaneHook | None) -> ExecutorFactory:
        """The same policy and streams, with a test hook run at the start of every lane."""
        return ExecutorFactory(self.policy, self.streams, lane_hook=hook)

    def choose(
        self, local_rows: int, *, graphs: bool, overlap_gathers: bool = True
    ) -> LayerExecutors:
        use = self.policy.decide(local_rows, graphs=graphs, cuda=self.streams is not None)
        serial = SERIAL if overlap_gathers else SerialExecutor(overlap_gathers=False)
        multi = None
        if use and self.streams is not None:
            multi = MultistreamExecutor(
                self.streams, lane_hook=self.lane_hook, overlap_gathers=overlap_gathers
            )
        return LayerExecutors(serial, multi, self.policy, local_rows)
