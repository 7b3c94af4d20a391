"""The caller's side of one request: events (blocking or asyncio), cancel, result."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING

from ..api import GenerationRequest, GenerationResult, TokenEvent

if TYPE_CHECKING:
    from .admission import Ticket

logger = logging.getLogger(__name__)

Event = TokenEvent | GenerationResult


class RequestHandle:
    """Events, cancellation and the final result of one submitted request."""

    def __init__(self, request: GenerationRequest,
                 on_cancel: Callable[[RequestHandle], None] | None = None) -> None:
        self.request = request
        self._q: queue.Queue[Event] = queue.Queue()
        self._done = threading.Event()
        self._result: GenerationResult | None = None
        self._consumed = False
        self._cancelled = threading.Event()
        self._on_cancel = on_cancel
        self._lock = threading.Lock()
        self._async: tuple[asyncio.AbstractEventLoop, asyncio.Queue[Event]] | None = None
        # the admission ticket while the request waits for or holds a slot (engine side)
        self.ticket: Ticket | None = None


    def emit(self, ev: Event) -> None:
        """Deliver an event (engine thread); nothing after the one result."""
        with self._lock:
            if self._result is not None:  # exactly one result; nothing after it
                return
            if isinstance(ev, GenerationResult):
                self._result = ev
                self._done.set()
            if self._async is not None:
                loop, aq = self._async
                try:
                    loop.call_soon_threadsafe(aq.put_nowait, ev)
                except RuntimeError:  # the consumer's event loop is closed: nobody listens
                    logger.debug("dropping an event for a closed event loop")
            else:
                self._q.put(ev)

    @property
    def cancel_requested(self) -> bool:
        return self._cancelled.is_set()


    def cancel(self) -> None:
        """Stop the request (e.g. client disconnect). Blocks already saved stay saved."""
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        if self._on_cancel is not None:
            self._on_cancel(self)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def events(self) -> Iterator[Event]:
        """Blocking iterator: TokenEvent ..., then the GenerationResult (single consumer)."""
        if self._consumed:
            raise RuntimeError("the events of a request can be consumed only once")
        self._consumed = True
        while True:
            ev = self._q.get()
            yield ev
            if isinstance(ev, GenerationResult):
                return

    async def aevents(self) -> AsyncIterator[Event]:
        """The same events for asyncio code."""
        if self._consumed:
            raise RuntimeError("the events of a request can be consumed only once")
        self._consumed = True
        aq: asyncio.Queue[Event] = asyncio.Queue()
        with self._lock:
            while True:  # events emitted before we started listening
                try:
                    aq.put_nowait(self._q.get_nowait())
                except queue.Empty:
                    break
            self._async = (asyncio.get_running_loop(), aq)
        while True:
            ev = await aq.get()
            yield ev
            if isinstance(ev, GenerationResult):
                return

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Wait for the final result (works whether or not events were consumed)."""
        if not self._done.wait(timeout):
            raise TimeoutError("the request did not finish in time")
        if self._result is None:  # pragma: no cover - _done is set only with a result
            raise RuntimeError("request finished without a result")
        return self._result
