"""Side-stream accounting (CPU, with stand-in streams): no two live owners ever hold the same
stream, freed streams are reused, and torch's pool running out is a clear error, not a collision."""

from __future__ import annotations

import gc
import itertools
import threading
from dataclasses import dataclass

import pytest

from dsv4cp.side_streams import MODE_ENV, SideStreamError, SideStreamRegistry, _build_registry


@dataclass(eq=False)
class FakeStream:
    cuda_stream: int
    device: int


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
    held = [reg.acquire(0) for _ in range(40)]  # 8 ranks x 5 streams: more than torch's pool
    assert len({s.cuda_stream for s in held}) == 40 and 99 in {s.cuda_stream for s in held}
    assert len(made) == 39 and reg.held(0) == 40
    gone = held.pop(7).cuda_stream
    gc.collect()
    assert reg.held(0) == 39
    again = reg.acquire(0)
    assert again.cuda_stream == gone and len(made) == 39  # reused, nothing new made
    assert reg.acquire(1).cuda_stream not in {s.cuda_stream for s in held}  # per device


def test_external_streams_from_many_threads_never_collide() -> None:
    reg, _ = _external()
    got: list[FakeStream] = []
    lock = threading.Lock()

    def rank() -> None:
        mine = [reg.acquire(0) for _ in range(5)]
        with lock:
            got.extend(mine)

    threads = [threading.Thread(target=rank) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({s.cuda_stream for s in got}) == 40


def test_pool_streams_skip_held_ones_and_run_out_clearly() -> None:
    reg = SideStreamRegistry(None, _pool(32), FakeStream, mode="pool")
    other = _pool(32)  # what torch's pool would give a caller that does not skip
    held = [reg.acquire(0) for _ in range(30)]
    assert len({s.cuda_stream for s in held}) == 30
    more = [reg.acquire(0) for _ in range(2)]
    assert len({s.cuda_stream for s in held + more}) == 32
    with pytest.raises(SideStreamError, match=r"all 32 streams of torch's pool on cuda:0 are held"):
        reg.acquire(0)
    del more
    gc.collect()
    assert reg.held(0) == 30
    assert reg.acquire(0).cuda_stream not in {s.cuda_stream for s in held}
    # without the registry the 33rd draw repeats the first stream: the collision it prevents
    draws = [other(0).cuda_stream for _ in range(33)]
    assert draws[32] == draws[0]


def test_mode_env_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODE_ENV, "dedicated")
    with pytest.raises(ValueError, match=f"{MODE_ENV} must be auto, external or pool"):
        _build_registry()
    monkeypatch.setenv(MODE_ENV, "pool")
    assert _build_registry().mode == "pool"


def test_pool_collects_owners_that_are_gone_before_giving_up() -> None:
    reg = SideStreamRegistry(None, _pool(32), FakeStream, mode="pool")
    held = [reg.acquire(0) for _ in range(31)]
    cycle: list = [reg.acquire(0)]  # a runner in a reference cycle: freed only by the collector
    cycle.append(cycle)
    gc.disable()
    try:
        del cycle
        assert reg.held(0) == 32
        fresh = reg.acquire(0)  # the registry collects once before it reports exhaustion
    finally:
        gc.enable()
    assert fresh.cuda_stream not in {s.cuda_stream for s in held}


def test_capacity_and_the_up_front_check() -> None:
    pool = SideStreamRegistry(None, _pool(32), FakeStream, mode="pool")
    assert pool.capacity(0) == 32
    pool.reserve_check(0, 32, "--cp 8 (fake) with --multistream")
    held = [pool.acquire(0) for _ in range(12)]
    with pytest.raises(SideStreamError, match=r"needs 21 side streams on cuda:0 and torch's pool"):
        pool.reserve_check(0, 21, "--cp 7 (fake) with --multistream")
    assert pool.held(0) == len(held)  # the check holds nothing
    reg, _ = _external()
    assert reg.capacity(0) is None
    reg.reserve_check(0, 10_000, "anything")
