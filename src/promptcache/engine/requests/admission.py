"""Admission control: how many requests run at once and how much KV they may hold (thread-safe).
Within ``max_active`` and ``kv_budget`` (``n x row_bytes(longest)``) a ticket is admitted, else
queued FIFO (full: ``OverloadedError``). Background tickets queue apart, never take the last slot
and are preempted for interactive ones; under memory ``pause`` / ``refuse`` one starts only
alone (``refuse`` rejects submits)."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...errors import OverloadedError, RequestError

# the longest Retry-After we send (a client should come back within ten minutes)
MAX_RETRY_AFTER_S = 600

WAITING, ADMITTED, TAKEN, RELEASED, CANCELLED = "waiting", "admitted", "taken", "released", "cancelled"


@dataclass(eq=False)
class Ticket:
    """One request's claim on the engine (``item`` is whatever the engine needs)."""

    item: Any
    length: int  # prompt + max_tokens: what its KV may grow to
    background: bool = False
    t_submit: float = 0.0
    t_admit: float | None = None
    state: str = WAITING
    preempted: bool = False  # a background ticket asked to give its slot back
    admit_seq: int = 0  # admission order (ties of t_admit broken deterministically)
    peak: int = 0  # its predicted memory peak in bytes (with a memory governor), else 0
    memory_waited: bool = False  # it waited for memory at least once (counted once)

    @property
    def queue_s(self) -> float:
        return 0.0 if self.t_admit is None else self.t_admit - self.t_submit


@dataclass
class AdmissionStats:
    admitted: int = 0
    rejected: int = 0
    queued_total: int = 0
    cancelled_waiting: int = 0
    wait_s_total: float = 0.0
    wait_s_max: float = 0.0
    peak_active: int = 0
    recent_service_s: float = 0.0  # EWMA of admitted-to-release times
    recent_wait_s: float = 0.0  # EWMA of submit-to-admission times (queued requests)
    background_admitted: int = 0
    background_rejected: int = 0
    background_preempted: int = 0
    memory_waits: int = 0  # tickets that waited because their peak did not fit yet

    def to_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass
class Admission:
    max_active: int
    max_queued: int
    kv_budget: int | None
    row_bytes: Callable[[int], int]
    clock: Callable[[], float] = time.monotonic
    stats: AdmissionStats = field(default_factory=AdmissionStats)
    # called outside the lock for each background ticket preempted for an interactive one
    on_preempt: Callable[[Ticket], None] | None = None

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: tuple[deque[Ticket], deque[Ticket]] = (deque(), deque())  # interactive, background
        self._num_waiting = 0  # interactive tickets waiting
        self._bg_waiting = 0  # background tickets waiting
        self._active: set[Ticket] = set()
        self._ready: deque[Ticket] = deque()  # admitted, not yet taken by the engine
        self._admits = 0
        self._interactive_submits = 0  # interactive tickets ever submitted
        self._pressure = "ok"  # the memory governor's level: ok | pause | refuse
        # with a memory governor: whether a waiting ticket's predicted peak fits beside the running
        # ones
        self.memory_fits: Callable[[int, int], bool] | None = None
        self._pressure_retry = 1
        self.memory_refused = 0  # submits refused for memory


    def footprint(self, lengths: list[int]) -> int:
        """KV bytes of a batch of rows with these lengths (every row padded to the longest)."""
        return len(lengths) * self.row_bytes(max(lengths)) if lengths else 0

    def room(self) -> int | None:
        """KV bytes the reservations leave free (None: no budget), for the prefill workspace."""
        if self.kv_budget is None:
            return None
        with self._lock:
            return self.kv_budget - self.footprint([a.length for a in self._active])

    def _fits(self, t: Ticket, without: frozenset[Ticket] | set[Ticket] = frozenset()) -> bool:
        """Whether ``t`` fits next to the admitted tickets (but those in ``without``)."""
        active = [a for a in self._active if a not in without] if without else self._active
        n = len(active)
        if n >= self.max_active:
            return False
        if t.background and self.max_active > 1 and n + 1 >= self.max_active:
            return False
        if self.kv_budget is None:
            return True
        lengths = [a.length for a in active] + [t.length]
        return self.footprint(lengths) <= self.kv_budget

    def _count_waiting(self, t: Ticket, delta: int) -> None:
        if t.background:
            self._bg_waiting += delta
        else:
            self._num_waiting += delta

    def _preemptions(self) -> list[Ticket]:
        """Background tickets (newest first) a waiting interactive one needs gone (marked)."""
        head = next((t for t in self._waiting[0] if t.state == WAITING), None)
        if head is None:
            return []
        newest = sorted((a for a in self._active if a.background),
                        key=lambda a: a.admit_seq, reverse=True)
        gone = {a for a in newest if a.preempted}
        if self._fits(head, gone):
            return []
        out: list[Ticket] = []
        for a in newest:
            if a.preempted:
                continue
            gone.add(a)
            out.append(a)
            if self._fits(head, gone):
                for x in out:
                    x.preempted = True
                self.stats.background_preempted += len(out)
                return out
        return []

    def _covered(self) -> int:
        """How many waiting interactive tickets (in order) fit once the preempted ones go."""
        gone = {a for a in self._active if a.preempted}
        if not gone:
            return 0
        kept = [a for a in self._active if a not in gone]  # order does not matter here
        n = 0
        for t in self._waiting[0]:
            if t.state != WAITING:
                continue
            if not self._fits_among(t, kept):
                break
            kept.append(t)
            n += 1
        return n

    def _fits_among(self, t: Ticket, active: list[Ticket]) -> bool:
        if len(active) >= self.max_active:
            return False
        if self.kv_budget is None:
            return True
        return self.footprint([a.length for a in active] + [t.length]) <= self.kv_budget

    def _tell_preempted(self, tickets: list[Ticket]) -> None:
        if self.on_preempt is None:
            return
        for t in tickets:
            self.on_preempt(t)

    def _admit(self, t: Ticket) -> None:
        now = self.clock()
        t.state, t.t_admit = ADMITTED, now
        self._admits += 1
        t.admit_seq = self._admits
        self._active.add(t)
        self._ready.append(t)
        s = self.stats
        s.peak_active = max(s.peak_active, len(self._active))  # slots in use, any class
        if t.background:
            s.background_admitted += 1
            return
        s.admitted += 1
        wait = now - t.t_submit
        s.wait_s_total += wait
        s.wait_s_max = max(s.wait_s_max, wait)
        s.recent_wait_s = wait if s.recent_wait_s == 0 else 0.8 * s.recent_wait_s + 0.2 * wait

    def _admit_waiting(self) -> None:
        interactive, background = self._waiting
        for q in (interactive, background):
            while q:
                head = q[0]
                if head.state == CANCELLED:
                    q.popleft()
                    continue
                if q is background and interactive:
                    return
                if self._pressure != "ok" and self._active:
                    return  # under memory pressure: one at a time
                if not self._fits(head):
                    return
                if self._active and self.memory_fits is not None and not self.memory_fits(
                        head.peak, sum(a.peak for a in self._active)):
                    if not head.memory_waited:
                        head.memory_waited = True
                        self.stats.memory_waits += 1
                    return  # its peak does not fit beside the running ones: it waits
                q.popleft()
                self._count_waiting(head, -1)
                self._admit(head)

    def retry_estimate(self) -> int:
        """``retry_after_s`` for callers that do not hold the lock."""
        with self._lock:
            return self.retry_after_s()

    def retry_after_s(self) -> int:
        """Seconds a refused client should wait (service and queue-wait EWMAs); lock held."""
        now = self.clock()
        service = self.stats.recent_service_s
        if service == 0:
            ages = [now - t.t_admit for t in self._active if t.t_admit is not None]
            service = max(ages, default=0.0) or 1.0
        rounds = (self._num_waiting + 1) / max(1, self.max_active)
        estimate = max(service * rounds, self.stats.recent_wait_s)
        return int(min(MAX_RETRY_AFTER_S, max(1, math.ceil(estimate))))


    def submit(self, t: Ticket) -> None:
        """Admit or queue ``t``; ``OverloadedError`` (queue full), ``RequestError`` (too big)."""
        if self.kv_budget is not None and self.row_bytes(t.length) > self.kv_budget:
            raise RequestError(
                f"prompt + max_tokens ({t.length} tokens) need {self.row_bytes(t.length)} "
                f"bytes of KV, more than the active-KV budget of {self.kv_budget} bytes")
        with self._lock:
            t.t_submit = self.clock()
            self._interactive_submits += not t.background
            if self._pressure == "refuse":
                t.state = CANCELLED
                self.memory_refused += 1
                if t.background:
                    self.stats.background_rejected += 1
                else:
                    self.stats.rejected += 1
                retry = self._pressure_retry
                raise OverloadedError(
                    f"the server is short of memory (past its --memory-limit's hard "
                    f"watermark); retry in {retry}s", retry_after_s=retry)
            q = self._waiting[1 if t.background else 0]
            t.state = WAITING
            q.append(t)
            self._count_waiting(t, +1)
            self._admit_waiting()
            if t.state != WAITING:
                return
            preempt = [] if t.background else self._preemptions()
            # interactive tickets waiting only for preempted ones hold no queue position
            waiting = self._bg_waiting if t.background else self._num_waiting - self._covered()
            if waiting > self.max_queued:
                q.pop()  # t is the last of its queue: _admit_waiting pops from the left
                self._count_waiting(t, -1)
                t.state = CANCELLED
                retry = self.retry_after_s()
                if t.background:
                    self.stats.background_rejected += 1
                else:
                    self.stats.rejected += 1
                raise OverloadedError(
                    f"the server is at capacity ({len(self._active)} active requests, "
                    f"{waiting - 1} waiting); retry in {retry}s", retry_after_s=retry)
            if not t.background:
                self.stats.queued_total += 1
        self._tell_preempted(preempt)

    def cancel(self, t: Ticket) -> bool:
        """Take a waiting ticket out of the queue (True); False if it was not waiting."""
        with self._lock:
            if t.state != WAITING:
                return False
            t.state = CANCELLED
            self._count_waiting(t, -1)
            self.stats.cancelled_waiting += 1
            # the ticket may have held up the ones behind it (FIFO)
            self._admit_waiting()
            preempt = self._preemptions()
        self._tell_preempted(preempt)
        return True


    def take(self) -> list[Ticket]:
        """Admitted tickets the engine has not started yet (in admission order)."""
        with self._lock:
            out = [t for t in self._ready if t.state == ADMITTED]  # not released meanwhile
            self._ready.clear()
            for t in out:
                t.state = TAKEN
            return out

    def release(self, t: Ticket) -> None:
        """A ticket's request finished: free its slot and admit who fits now."""
        with self._lock:
            if t not in self._active:
                return
            self._active.discard(t)
            t.state = RELEASED
            if t.t_admit is not None and not t.background:
                service = self.clock() - t.t_admit
                prev = self.stats.recent_service_s
                self.stats.recent_service_s = service if prev == 0 else 0.8 * prev + 0.2 * service
            self._admit_waiting()
            preempt = self._preemptions()
        self._tell_preempted(preempt)

    def drain(self) -> list[Ticket]:
        """Every ticket not yet taken (waiting or admitted): the engine is going away."""
        with self._lock:
            out = [t for q in self._waiting for t in q if t.state == WAITING]
            out += [t for t in self._ready if t.state == ADMITTED]
            for q in self._waiting:
                q.clear()
            self._ready.clear()
            self._num_waiting = self._bg_waiting = 0
            for t in out:
                self._active.discard(t)
                t.state = CANCELLED
            return out

    def set_pressure(self, level: str, retry_after_s: int = 1) -> None:
        """Set the memory governor's level (``ok`` | ``pause`` | ``refuse``) and its Retry-After."""
        if level not in ("ok", "pause", "refuse"):
            raise ValueError(f"pressure level must be ok, pause or refuse, got {level!r}")
        with self._lock:
            self._pressure = level
            self._pressure_retry = max(1, min(MAX_RETRY_AFTER_S, int(retry_after_s)))
            self._admit_waiting()
            preempt = self._preemptions()
        self._tell_preempted(preempt)

    @property
    def has_ready(self) -> bool:
        return bool(self._ready)

    @property
    def interactive_submits(self) -> int:
        """Interactive tickets submitted so far (the engine gathers a burst per new arrival)."""
        return self._interactive_submits

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            lengths = [t.length for t in self._active]
            background = sum(t.background for t in self._active)
            return {
                "active": len(self._active) - background,
                "queued": self._num_waiting,
                "background_active": background,
                "background_queued": self._bg_waiting,
                "max_active": self.max_active,
                "max_queued": self.max_queued,
                "kv_budget_bytes": self.kv_budget,
                "kv_reserved_bytes": self.footprint(lengths),
                "memory_pressure": self._pressure,
                "memory_refused_requests": self.memory_refused,
                **self.stats.to_dict(),
            }
