"""The engine thread's wake-up, stop flag and the gathering of a burst of arrivals.

Requests a client sends together reach the engine one after the other: the server
prepares them (template, tokenization) in one worker thread, one at a time. An idle
engine woken by the first would prefill it alone and the others as a second batch
after it -- the first stream's decode then waits for their prefill, and the last
stream's first token for both. So an idle engine woken by an arrival ``gather``s:

- it waits while more requests arrive, each within one ``window`` of the last (at
  most 5 windows in all, as before announcements existed);
- the server ``announce``s every generation request when it starts preparing it and
  releases the announcement when the preparation ends (just before its ``submit``):
  while announced requests are still being prepared the engine keeps waiting (at most
  ``max_s`` from the wake-up), and after each release one more window, for its submit.

A request that arrives alone, with nothing else being prepared, waits one window.
Announcements are counted whether the engine is idle or not; only an idle engine
waits for them (a busy one takes new requests at its next step).
"""

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
        """One request is being prepared; returns its release (idempotent: call it
        when the preparation ends, whether or not the request is submitted)."""
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
        """Called by the engine thread woken from idle; returns the number of waits
        (see the module docstring). ``window <= 0``: no gathering. ``on_wake`` runs at
        every wake-up meanwhile (the engine runs the calls made of it: a request being
        prepared may wait for one, ``Engine.call``)."""
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
