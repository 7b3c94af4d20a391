"""Calls run on the engine thread between two steps, bounded waits, degrade-and-count."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar, cast

from ...errors import EngineDeadError
from ..port import ENGINE_CALL_TIMEOUT_S

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineCallTimeout(TimeoutError):
    """``Engine.call``: the engine thread did not run the call in time."""


@dataclasses.dataclass(eq=False)
class _Call:
    """A function the engine thread runs between two steps (``Engine.call``)."""

    fn: Callable[[], Any]
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    value: Any = None
    error: BaseException | None = None
    abandoned: bool = False  # the caller stopped waiting: not run




class EngineCalls:
    """The queue of ``Engine.call``s run in order on the engine thread (``refusal``: why not)."""

    def __init__(self, thread: threading.Thread, wake: threading.Event,
                 refusal: Callable[[], str | None]) -> None:
        self._thread = thread
        self._wake = wake
        self._refusal = refusal
        self._calls: deque[_Call] = deque()
        self._lock = threading.Lock()
        self.stats = {"engine_calls": 0, "engine_calls_failed": 0,
                      "engine_calls_timed_out": 0}

    @property
    def pending(self) -> bool:
        return bool(self._calls)

    def call(self, fn: Callable[[], T], timeout: float | None = ENGINE_CALL_TIMEOUT_S) -> T:
        """Run ``fn()`` on the engine thread between steps; its result, or ``EngineCallTimeout`` /
        ``EngineDeadError``."""
        if threading.current_thread() is self._thread:
            return fn()
        refused = self._refusal()
        if refused is not None:
            raise EngineDeadError(refused)
        job = _Call(fn)
        self._calls.append(job)
        self._wake.set()
        if not self._thread.is_alive():  # ended meanwhile: nobody will take it
            self.fail("the engine is closed")
        if not job.done.wait(timeout):
            job.abandoned = True
            raise EngineCallTimeout(f"the engine thread did not run the call in {timeout} s")
        if job.error is not None:
            raise job.error
        return cast(T, job.value)

    def degrade(self, what: str, fn: Callable[[], T], default: T,
                 timeout: float | None = ENGINE_CALL_TIMEOUT_S) -> T:
        """``call(fn)``, or ``default`` (logged, counted) on failure: never fails a request."""
        try:
            value = self.call(fn, timeout)
        except EngineCallTimeout:
            self._count("engine_calls_timed_out")
            logger.warning("%s: the engine thread did not run it in %s s", what, timeout)
            return default
        except Exception:
            self._count("engine_calls_failed")
            logger.warning("%s failed", what, exc_info=True)
            return default
        self._count(None)
        return value

    def _count(self, outcome: str | None) -> None:
        with self._lock:  # callers on several threads
            self.stats["engine_calls"] += 1
            if outcome is not None:
                self.stats[outcome] += 1

    def run(self) -> None:
        """Run the waiting ``call``s (engine thread), in the order they came."""
        while True:
            try:
                job = self._calls.popleft()
            except IndexError:
                return
            if job.abandoned:
                continue
            try:
                job.value = job.fn()
            except Exception as e:  # the caller gets it; the engine thread goes on
                job.error = e
            finally:
                job.done.set()

    def fail(self, error: str) -> None:
        """Answer every waiting call (the engine thread is ending)."""
        while True:
            try:
                job = self._calls.popleft()
            except IndexError:
                return
            job.error = EngineDeadError(error)
            job.done.set()
