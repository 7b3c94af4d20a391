"""Burst gathering (engine/requests/arrivals.py) on a scripted clock and wake-up event: arrivals
within a window of each other, at most 5 windows; announced preparations hold the
gathering until they end (plus one window for the submit), at most ``max_s``."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from promptcache.engine.requests.arrivals import Arrivals

W = 2.0**-7  # a window (a power of two: the scripted times add up exactly)


class _Timeline:
    """A clock and a wake-up event driven by a script of (time, action) events: an
    event wakes the waiter at its time (after running its action)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.events: list[tuple[float, Callable[[], None]]] = []
        self.timeouts: list[float] = []

    def __call__(self) -> float:
        return self.now

    def at(self, t: float, action: Callable[[], None] = lambda: None) -> None:
        self.events.append((t, action))
        self.events.sort(key=lambda e: e[0])

    def wait(self, timeout: float) -> bool:
        self.timeouts.append(timeout)
        if self.events and self.events[0][0] <= self.now + timeout:
            t, action = self.events.pop(0)
            self.now = max(self.now, t)
            action()
            return True
        self.now += timeout
        return False

    def set(self) -> None:  # a release wakes the engine: the scripted event stands for it
        pass

    def clear(self) -> None:
        pass


def _arrivals() -> tuple[Arrivals, _Timeline]:
    tl = _Timeline()
    arr = Arrivals(clock=tl)
    arr.wake = tl  # type: ignore[assignment]
    return arr, tl


def test_a_lone_arrival_waits_one_window() -> None:
    arr, tl = _arrivals()
    assert arr.gather(W, 1.0) == 1
    assert tl.now == W and tl.timeouts == [W]


def test_arrivals_within_a_window_of_each_other_are_gathered() -> None:
    arr, tl = _arrivals()
    tl.at(W / 2)
    tl.at(W)
    assert arr.gather(W, 1.0) == 3
    assert tl.now == 2 * W and not tl.events


def test_a_steady_stream_is_capped_at_five_windows() -> None:
    arr, tl = _arrivals()
    for i in range(1, 51):
        tl.at(i * W / 2)
    assert arr.gather(W, 0.0) == 10
    assert tl.now == 5 * W
    assert all(0 < t <= W for t in tl.timeouts)


def test_announced_preparations_are_waited_for_then_one_window_for_the_submit() -> None:
    arr, tl = _arrivals()
    releases = [arr.announce() for _ in range(7)]  # 7 more being prepared, one at a time
    assert arr.incoming == 7
    for i, release in enumerate(releases):
        done = (3 * i + 3) * W  # each preparation takes 3 windows (> the window)
        tl.at(done, release)
        tl.at(done + W / 4)  # its submit
    assert arr.gather(W, 64 * W) > 7
    assert arr.incoming == 0 and not tl.events  # every submit was waited for
    assert tl.now == 21 * W + W  # the last submit at 21.25 W; one window after its release


def test_a_preparation_that_never_ends_is_waited_for_at_most_max_s() -> None:
    arr, tl = _arrivals()
    arr.announce()
    arr.gather(W, 20 * W)
    assert tl.now == 20 * W
    assert arr.incoming == 1


def test_without_a_window_nothing_is_gathered() -> None:
    arr, tl = _arrivals()
    arr.announce()
    assert arr.gather(0.0, 1.0) == 0
    assert tl.timeouts == [] and tl.now == 0


def test_a_release_counts_once_and_wakes_the_engine() -> None:
    arr = Arrivals()
    release = arr.announce()
    arr.announce()
    assert arr.incoming == 2
    release()
    release()
    assert arr.incoming == 1
    assert arr.wake.is_set()


def test_stopping_ends_the_gathering() -> None:
    arr, tl = _arrivals()
    arr.announce()
    tl.at(W / 2, lambda: setattr(arr, "stopping", True))
    arr.gather(W, 1.0)
    assert tl.now == W / 2


@pytest.mark.parametrize("bad", [-0.1, 10.5])
def test_burst_gather_max_s_is_validated(bad: float) -> None:
    from promptcache.serving_config import EngineConfig

    with pytest.raises(ValueError, match="burst_gather_max_s"):
        EngineConfig(burst_gather_max_s=bad)
