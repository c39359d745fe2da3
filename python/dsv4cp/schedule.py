"""The forward prepare of one attention layer as data: a DAG of named nodes on stream lanes.

A `Schedule` is a list of steps in host issue order: `Node`s (work on one lane, with declared
reads and writes), `Fork`s (lanes wait on the default lane), `Join`s (the default lane waits on
lanes) and `Release`s (a buffer is dropped). One schedule, several executors (`executors.py`:
serial, and multistream with each lane on its own CUDA stream).

`validate` rejects a schedule that reads a buffer before its writer is ordered before the
reader, issues a collective off the default lane or while a side-chain lane is open, or releases
a buffer a lane still reads before that lane's join. Compute-only lanes (`Fork(...,
compute_only=True)`, e.g. the Q projection) may stay open across the gathers: they carry no
collective (and, forked before the gathers, cannot read gathered rows), which is what lets the Q
GEMM overlap the all-gathers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

DEFAULT = "default"


@dataclass(frozen=True)
class Node:
    name: str
    fn: Callable[[PrepareState], None]
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    lane: str = DEFAULT
    collective: bool = False


@dataclass(frozen=True)
class Fork:
    lanes: tuple[str, ...]
    compute_only: bool = False


@dataclass(frozen=True)
class Join:
    lanes: tuple[str, ...]


@dataclass(frozen=True)
class Release:
    names: tuple[str, ...]


Step = Union[Node, Fork, Join, Release]


class ScheduleError(ValueError):
    pass


class PrepareState(dict[str, Any]):
    """Named buffers of one layer's prepare, plus the objects nodes need (`ctx`)."""

    def __init__(self, ctx: Any, **buffers: Any) -> None:
        super().__init__(**buffers)
        self.ctx = ctx


@dataclass(frozen=True)
class Schedule:
    name: str
    steps: tuple[Step, ...]
    inputs: tuple[str, ...] = ("x",)
    outputs: tuple[str, ...] = ()

    @property
    def nodes(self) -> list[Node]:
        return [s for s in self.steps if isinstance(s, Node)]

    @property
    def lanes(self) -> list[str]:
        seen: list[str] = []
        for n in self.nodes:
            if n.lane not in seen:
                seen.append(n.lane)
        return seen

    def collectives(self) -> list[str]:
        return [n.name for n in self.nodes if n.collective]

    def describe(self) -> str:
        lines = [f"schedule {self.name}"]
        for s in self.steps:
            if isinstance(s, Node):
                flag = " [collective]" if s.collective else ""
                lines.append(
                    f"  {s.lane:>10} | {s.name}{flag}: "
                    f"{', '.join(s.reads)} -> {', '.join(s.writes)}"
                )
            elif isinstance(s, Fork):
                lines.append(
                    f"  fork {', '.join(s.lanes)}" + (" (compute-only)" if s.compute_only else "")
                )
            elif isinstance(s, Join):
                lines.append(f"  join {', '.join(s.lanes)}")
            else:
                lines.append(f"  release {', '.join(s.names)}")
        return "\n".join(lines)


@dataclass
class _Producer:
    lane: str
    step: int
    joined: bool = False


@dataclass
class _LaneState:
    open: bool = False
    compute_only: bool = False
    fork_step: int = -1
    reads: set[str] = field(default_factory=set)


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError naming the first violated rule (see the module docstring)."""
    produced: dict[str, _Producer] = {name: _Producer(DEFAULT, -1) for name in schedule.inputs}
    lanes: dict[str, _LaneState] = {}
    released: set[str] = set()

    def where(i: int, node: Node | None = None) -> str:
        return f"schedule {schedule.name!r}, step {i}" + (f" ({node.name})" if node else "")

    for i, step in enumerate(schedule.steps):
        if isinstance(step, Fork):
            for lane in step.lanes:
                if lane == DEFAULT:
                    raise ScheduleError(f"{where(i)}: cannot fork the default lane")
                st = lanes.setdefault(lane, _LaneState())
                if st.open:
                    raise ScheduleError(f"{where(i)}: lane {lane!r} forked twice without a join")
                lanes[lane] = _LaneState(True, step.compute_only, i)
        elif isinstance(step, Join):
            for lane in step.lanes:
                joined = lanes.get(lane)
                if joined is None or not joined.open:
                    raise ScheduleError(f"{where(i)}: join of lane {lane!r} that is not open")
                joined.open = False
                for p in produced.values():
                    if p.lane == lane:
                        p.joined = True
        elif isinstance(step, Release):
            for name in step.names:
                if name not in produced:
                    raise ScheduleError(f"{where(i)}: release of unknown buffer {name!r}")
                for lane, st in lanes.items():
                    if st.open and name in st.reads:
                        raise ScheduleError(
                            f"{where(i)}: {name!r} is released while lane {lane!r}, which reads "
                            "it, has not been joined"
                        )
                p = produced[name]
                if p.lane != DEFAULT and not p.joined:
                    raise ScheduleError(
                        f"{where(i)}: {name!r} is released before lane {p.lane!r} is joined"
                    )
                released.add(name)
        else:
            node = step
            if node.lane != DEFAULT and not lanes.get(node.lane, _LaneState()).open:
                raise ScheduleError(f"{where(i, node)}: lane {node.lane!r} runs before its fork")
            if node.collective:
                if node.lane != DEFAULT:
                    raise ScheduleError(
                        f"{where(i, node)}: collective on lane {node.lane!r}; collectives run "
                        "only on the default lane (cross-rank order)"
                    )
                open_side = [n for n, st in lanes.items() if st.open and not st.compute_only]
                if open_side:
                    raise ScheduleError(
                        f"{where(i, node)}: collective inside the fork/join region of "
                        f"{open_side}; issue every gather before the fork"
                    )
            for name in node.reads:
                if name in released:
                    raise ScheduleError(f"{where(i, node)}: reads {name!r} after its release")
                writer = produced.get(name)
                if writer is None:
                    raise ScheduleError(f"{where(i, node)}: reads {name!r} before any writer")
                _check_order(schedule, i, node, name, writer, lanes)
                if node.lane != DEFAULT:
                    lanes[node.lane].reads.add(name)
            for name in node.writes:
                produced[name] = _Producer(node.lane, i)
    open_lanes = [n for n, st in lanes.items() if st.open]
    if open_lanes:
        raise ScheduleError(f"schedule {schedule.name!r}: lanes {open_lanes} are never joined")
    for name in schedule.outputs:
        if name not in produced:
            raise ScheduleError(f"schedule {schedule.name!r}: output {name!r} is never written")


def _check_order(
    schedule: Schedule, i: int, node: Node, name: str, p: _Producer, lanes: dict[str, _LaneState]
) -> None:
    if p.lane == node.lane:
        return
    ok = False
    if p.lane == DEFAULT:
        # Default-lane work is visible to a side lane only if issued before that lane's fork.
        ok = node.lane == DEFAULT or p.step < lanes[node.lane].fork_step
    elif node.lane == DEFAULT:
        ok = p.joined
    if not ok:
        raise ScheduleError(
            f"schedule {schedule.name!r}, step {i} ({node.name}): reads {name!r} written on lane "
            f"{p.lane!r} without a fork/join ordering them"
        )


def lanes_of(schedules: Sequence[Schedule]) -> list[str]:
    out: list[str] = []
    for s in schedules:
        for lane in s.lanes:
            if lane != DEFAULT and lane not in out:
                out.append(lane)
    return out
