"""Side-stream accounting (CPU, with stand-in streams): no two live owners ever hold the same
stream, streams of collected owners are reused, and torch's pool running out is a clear error,
not a collision. The stand-in streams cannot be weak-referenced at all: torch's stream objects
never run weakref callbacks, so the registry must key a stream's release on its owner."""

from __future__ import annotations

import gc
import itertools
import threading
from dataclasses import dataclass

import pytest

from dsv4cp.side_streams import MODE_ENV, SideStreamError, SideStreamRegistry, _build_registry


@dataclass(eq=False, slots=True)  # no __weakref__: a finalizer on the stream raises
class FakeStream:
    cuda_stream: int
    device: int


class Owner:
    """A runner, executor pool or graph: holds its streams until it is collected."""

    def __init__(self, reg: SideStreamRegistry, device: int = 0, n: int = 1) -> None:
        self.streams = [reg.acquire(device, self) for _ in range(n)]

    @property
    def ids(self) -> set[int]:
        return {s.cuda_stream for s in self.streams}


def _ids(owners: list[Owner]) -> set[int]:
    return set().union(*(o.ids for o in owners))


def _pool(size: int):  # noqa: ANN202 - torch's round-robin pool, shared by every caller
    counter = itertools.count()

    def draw(device: int) -> FakeStream:
        return FakeStream(1000 * (device + 1) + next(counter) % size, device)

    return draw


def _external() -> tuple[SideStreamRegistry, list[int]]:
    made: list[int] = []

    def create(device: int) -> int:
        made.append(len(made) + 1)
        return made[-1]

    reg = SideStreamRegistry(create, _pool(32), FakeStream, mode="runtime", spare={0: [99]})
    return reg, made


def test_external_streams_are_distinct_and_reused_after_release() -> None:
    reg, made = _external()
    held = [Owner(reg, n=5) for _ in range(8)]  # 8 ranks x 5 streams: more than torch's pool
    assert len(_ids(held)) == 40 and 99 in _ids(held)
    assert len(made) == 39 and reg.held(0) == 40
    gone = held.pop(3).ids
    gc.collect()
    assert reg.held(0) == 35
    again = Owner(reg, n=5)
    assert again.ids == gone and len(made) == 39  # reused, nothing new made
    assert not Owner(reg, device=1).ids & _ids(held)  # per device


def test_external_streams_from_many_threads_never_collide() -> None:
    reg, _ = _external()
    got: list[Owner] = []
    lock = threading.Lock()

    def rank() -> None:
        mine = Owner(reg, n=5)
        with lock:
            got.append(mine)

    threads = [threading.Thread(target=rank) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(_ids(got)) == 40


def test_pool_streams_skip_held_ones_and_run_out_clearly() -> None:
    reg = SideStreamRegistry(None, _pool(32), FakeStream, mode="pool")
    other = _pool(32)  # what torch's pool would give a caller that does not skip
    held = [Owner(reg, n=5) for _ in range(6)]
    assert len(_ids(held)) == 30
    more = Owner(reg, n=2)
    assert len(_ids([*held, more])) == 32
    with pytest.raises(SideStreamError, match=r"all 32 streams of torch's pool on cuda:0 are held"):
        Owner(reg)
    del more
    gc.collect()
    assert reg.held(0) == 30
    assert not Owner(reg).ids & _ids(held)
    # without the registry the 33rd draw repeats the first stream: the collision it prevents
    draws = [other(0).cuda_stream for _ in range(33)]
    assert draws[32] == draws[0]


def test_mode_env_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODE_ENV, "dedicated")
    with pytest.raises(ValueError, match=f"{MODE_ENV} must be one of auto, external, pool"):
        _build_registry()
    monkeypatch.setenv(MODE_ENV, "pool")
    assert _build_registry().mode == "pool"


def test_pool_collects_owners_that_are_gone_before_giving_up() -> None:
    reg = SideStreamRegistry(None, _pool(32), FakeStream, mode="pool")
    held = [Owner(reg) for _ in range(31)]
    cycle = Owner(reg)  # a runner in a reference cycle: freed only by the collector
    cycle.me = cycle  # type: ignore[attr-defined]
    gc.disable()
    try:
        del cycle
        assert reg.held(0) == 32
        fresh = Owner(reg)  # the registry collects once before it reports exhaustion
    finally:
        gc.enable()
    assert not fresh.ids & _ids(held)


def test_a_stream_outliving_its_owner_is_not_held() -> None:
    # What the owner rule means: the stream object alone keeps nothing held.
    reg = SideStreamRegistry(None, _pool(32), FakeStream, mode="pool")
    owner = Owner(reg, n=3)
    kept = list(owner.streams)
    del owner
    gc.collect()
    assert reg.held(0) == 0 and len(kept) == 3


def test_capacity_and_the_up_front_check() -> None:
    pool = SideStreamRegistry(None, _pool(32), FakeStream, mode="pool")
    assert pool.capacity(0) == 32
    pool.reserve_check(0, 32, "--cp 8 (fake) with --multistream")
    held = Owner(pool, n=12)
    with pytest.raises(SideStreamError, match=r"needs 21 side streams on cuda:0 and torch's pool"):
        pool.reserve_check(0, 21, "--cp 7 (fake) with --multistream")
    assert pool.held(0) == len(held.streams)  # the check holds nothing
    reg, _ = _external()
    assert reg.capacity(0) is None
    reg.reserve_check(0, 10_000, "anything")


@pytest.mark.parametrize(("multistream", "graphs"), [(True, False), (False, True), (True, True)])
def test_fake_cp_streams_are_counted_up_front(
    monkeypatch: pytest.MonkeyPatch, multistream: bool, graphs: bool
) -> None:
    """`check` / `demo` with fake CP on CUDA count each rank's lanes (--multistream) and its
    capture stream (--graphs), so a run that cannot have them is refused before any work."""
    import argparse

    import dsv4cp.side_streams as side_streams
    from dsv4cp.commands.common import check_fake_side_streams
    from dsv4cp.config import DeepseekV41Config
    from dsv4cp.model import DeepseekV41Model

    asked: list[tuple[int, str]] = []
    monkeypatch.setattr(side_streams, "check_side_streams", lambda n, what: asked.append((n, what)))
    args = argparse.Namespace(device="cuda", cp=40, multistream=multistream, graphs=graphs)
    check_fake_side_streams(args, "fake")
    lanes = len(DeepseekV41Model(DeepseekV41Config.tiny(), seed=None).prepare_lanes())
    per_rank = (lanes if multistream else 0) + (1 if graphs else 0)
    assert [n for n, _ in asked] == [40 * per_rank]
    assert ("--graphs" in asked[0][1]) is graphs
    check_fake_side_streams(
        argparse.Namespace(device="cuda", cp=40, multistream=False, graphs=False), "fake"
    )
    check_fake_side_streams(args, "gloo")
    assert len(asked) == 1
