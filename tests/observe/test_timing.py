"""`observe.timing.stage`: the timer is reached through `use_timer`, not through arguments."""

from __future__ import annotations

import threading

import pytest

from dsv4cp.observe.timing import StageTimer, stage, use_timer


def test_stage_counts_only_under_a_current_timer() -> None:
    timer = StageTimer()
    with stage("before"):  # no timer current: nothing is recorded anywhere
        pass
    with use_timer(timer):
        with stage("a"), stage("b"):
            pass
        with stage("a"):
            pass
        with stage("layer", layer=3, timed=False):  # an enclosing range: never timed
            pass
    with stage("after"):
        pass
    assert dict(timer.count) == {"a": 2, "b": 1}
    assert sorted((name, calls) for name, _, calls in timer.rows()) == [("a", 2), ("b", 1)]


def test_timer_is_reset_after_an_exception_and_is_per_thread() -> None:
    timer = StageTimer()
    with pytest.raises(RuntimeError, match="boom"), use_timer(timer), stage("fails"):
        raise RuntimeError("boom")
    assert timer.count["fails"] == 1
    with stage("later"):
        pass
    assert "later" not in timer.count

    other = StageTimer()
    seen: list[str] = []

    def worker() -> None:  # a fresh thread starts without the caller's timer
        with stage("in_thread"):
            seen.append("ran")

    with use_timer(other):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert seen == ["ran"] and "in_thread" not in other.count
