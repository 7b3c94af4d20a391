"""The engine thread's wake-up, stop flag and the gathering of a burst of arrivals.

Requests sent together arrive one by one; so an idle engine waits while more arrive within a
``window`` and while announced ones are being prepared, to prefill them as one batch."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Arrivals:
    """Shared by the engine thread, ``submit`` callers, the server and the finalizer."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.stopping = False
        self.wake = threading.Event()
        self._clock = clock
        self._lock = threading.Lock()
        self._incoming = 0  # announced, still being prepared
        self._released = 0  # announcements released so far

    @property
    def incoming(self) -> int:
        return self._incoming

    def announce(self) -> Callable[[], None]:
        """One request is being prepared; returns its (idempotent) release."""
        with self._lock:
            self._incoming += 1
        done = False

        def release() -> None:
            nonlocal done
            with self._lock:
                if done:
                    return
                done = True
                self._incoming -= 1
                self._released += 1
            self.wake.set()

        return release

    def gather(self, window: float, max_s: float,
               on_wake: Callable[[], None] | None = None) -> int:
        """Wait for a burst (woken from idle); returns the waits; ``on_wake`` at each wake-up."""
        if window <= 0:
            return 0
        start = self._clock()
        quiet_end = start + 5 * window
        hard_end = start + max(max_s, 5 * window)
        seen = self._released
        waits = 0
        while not self.stopping:
            end = hard_end if self._incoming > 0 else quiet_end
            left = end - self._clock()
            if left <= 0:
                return waits
            waits += 1
            if self.wake.wait(min(window, left)):
                self.wake.clear()
                if on_wake is not None:
                    on_wake()
                if self._released != seen:  # a preparation ended: its submit follows
                    seen = self._released
                    quiet_end = min(hard_end, max(quiet_end, self._clock() + window))
                continue
            if self._incoming == 0:  # a quiet window and nothing being prepared
                return waits
        return waits
