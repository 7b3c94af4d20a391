"""The SSD tier's bounded write queue: a FIFO between ``put`` and the writer thread
whose waits all take a timeout (0: never wait, None: as long as it takes), so a put
can refuse at once on the request path, or apply back-pressure at shutdown, and a
flush can be bounded in time."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any


def _wait(cond: threading.Condition, ready: Callable[[], bool], timeout: float | None) -> bool:
    if ready():
        return True
    if timeout is not None and timeout <= 0:
        return False
    return cond.wait_for(ready, timeout)


class WriteQueue:
    """Bounded FIFO with ``task_done`` accounting (like ``queue.Queue``) plus
    ``wait_for_room`` and a ``join`` with a timeout."""

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._items: deque[Any] = deque()
        self._cond = threading.Condition()
        self._unfinished = 0

    def qsize(self) -> int:
        with self._cond:
            return len(self._items)

    def _has_room(self) -> bool:
        return len(self._items) < self.maxsize

    def put(self, item: Any, timeout: float | None = 0.0, *, force: bool = False) -> bool:
        """Append ``item`` if there is room (waiting up to ``timeout``); ``force``
        appends regardless of the bound (the stop marker). False if still full."""
        with self._cond:
            if not force and not _wait(self._cond, self._has_room, timeout):
                return False
            self._items.append(item)
            self._unfinished += 1
            self._cond.notify_all()
            return True

    def get(self, timeout: float | None) -> tuple[bool, Any]:
        """``(True, item)``, or ``(False, None)`` if nothing came within ``timeout``."""
        with self._cond:
            if not _wait(self._cond, lambda: bool(self._items), timeout):
                return False, None
            item = self._items.popleft()
            self._cond.notify_all()
            return True, item

    def task_done(self) -> None:
        with self._cond:
            if self._unfinished <= 0:
                raise ValueError("task_done() called more times than there were items")
            self._unfinished -= 1
            self._cond.notify_all()

    def wait_for_room(self, timeout: float | None = 0.0) -> bool:
        with self._cond:
            return _wait(self._cond, self._has_room, timeout)

    def join(self, timeout: float | None = None) -> bool:
        """Wait until every item put was processed (``task_done``). False on timeout."""
        with self._cond:
            return _wait(self._cond, lambda: self._unfinished == 0, timeout)
