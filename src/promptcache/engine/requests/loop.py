"""The engine thread's body (``EngineLoop``): calls, then one scheduler step; idle, shadow
verification or a wait, then burst gathering. An escaping exception kills the thread and fails every
request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import mlx.core as mx

from ...serving_config import EngineConfig
from ..governor import MemoryGovernor
from ..payload.shadow import ShadowVerifier
from .admission import Admission
from .arrivals import Arrivals
from .calls import EngineCalls
from .scheduler import Scheduler

logger = logging.getLogger(__name__)


class EngineLoop:
    """What the engine thread runs; ``fail_pending`` answers unstarted tickets."""

    def __init__(self, config: EngineConfig, scheduler: Scheduler, admission: Admission,
                 calls: EngineCalls, control: Arrivals, shadow: ShadowVerifier | None, *,
                 fail_pending: Callable[[str | None], None],
                 died: Callable[[str], None], governor: MemoryGovernor | None = None) -> None:
        self._config = config
        self._scheduler = scheduler
        self._admission = admission
        self._calls = calls
        self._control = control
        self._shadow = shadow
        self._fail_pending = fail_pending
        self._died = died
        self._governor = governor
        # interactive submits up to the last gathering (``_burst_behind_background``)
        self._gathered = 0

    def run(self) -> None:
        dead: str | None = None
        try:
            self._loop()
        except BaseException as e:  # the engine thread must never die silently
            dead = f"{type(e).__name__}: {e}"
            self._died(dead)
            logger.critical("the engine thread died: %s", dead, exc_info=True)
            error = f"the engine thread died: {dead}"
            try:
                self._scheduler.fail_all(error)
            finally:
                self._fail_pending(error)
        finally:
            self._calls.fail(f"the engine thread died: {dead}" if dead
                             else "the engine was closed")
            # destroy mlx's per-thread streams before the thread ends, or the process may abort at
            # exit
            mx.synchronize()
            mx.clear_streams()

    def _loop(self) -> None:
        sched, calls, control = self._scheduler, self._calls, self._control
        while True:
            if control.stopping:
                sched.fail_all("the engine was closed", reason="cancelled")
                self._fail_pending(None)
                return
            if calls.pending:
                calls.run()
            if self._governor is not None:
                self._governor.maybe_check()  # between steps: the memory limit
            if self._burst_behind_background():
                self._gather_burst()
            if not sched.step():
                # idle: one chunk of shadow verification (an arrival waits at most that)
                shadow = self._shadow
                if shadow is not None and shadow.pending and shadow.step():
                    continue
                # under memory pressure keep checking while idle, to admit what is held back
                g = self._governor
                control.wake.wait(g.idle_wait_s if g is not None else None)
                control.wake.clear()
                if calls.pending:
                    calls.run()
                    if not self._admission.has_ready:  # woken by a call, not an arrival
                        continue
                self._gather_burst()

    def _gather_burst(self) -> None:
        """Woken by an arrival: wait for the rest of a burst, to prefill it as one batch."""
        cfg = self._config
        self._control.gather(cfg.batch_window_s, cfg.burst_gather_max_s, self._calls.run)
        self._gathered = self._admission.interactive_submits

    def _burst_behind_background(self) -> bool:
        """An interactive arrival while only background work runs: gather as if idle."""
        submits = self._admission.interactive_submits
        if submits == self._gathered:
            return False
        sched = self._scheduler
        if sched.idle or sched.interactive_busy:
            # idle: the wake-up path gathers; busy: new requests join at the next step
            self._gathered = submits
            return False
        return True


def stop_thread(control: Arrivals, thread: threading.Thread) -> None:
    """Stop the engine thread (``close``, or the interpreter's exit) and wait for it."""
    control.stopping = True
    control.wake.set()
    if thread.is_alive() and thread is not threading.current_thread():
        thread.join(timeout=60)
