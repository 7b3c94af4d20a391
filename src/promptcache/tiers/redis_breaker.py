"""A circuit breaker for a remote tier (pure logic, injected clock; no I/O).

closed    every operation is attempted; ``failures`` consecutive failures open it.
open      operations are skipped at once (counted) until ``retry_at``; then one
          health probe is due (``begin_probe`` moves to half-open).
half_open operations are still skipped; the probe's result closes the circuit
          (backoff reset) or opens it again with the backoff doubled, up to the max.

The prober (a thread in the tier) asks ``begin_probe`` periodically, so a request
never waits for a probe. Thread safety: callers hold their own lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(
        self,
        *,
        failures: int = 3,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failures < 1:
            raise ValueError(f"failures must be >= 1, got {failures}")
        if not 0 < backoff_s <= max_backoff_s:
            raise ValueError("need 0 < backoff_s <= max_backoff_s")
        self.threshold = failures
        self.base_backoff = backoff_s
        self.max_backoff = max_backoff_s
        self.clock = clock
        self.state = CLOSED
        self.consecutive_failures = 0
        self.backoff = backoff_s
        self.retry_at = 0.0
        self.trips = 0  # closed -> open transitions
        self.recoveries = 0  # half_open -> closed transitions
        self.skipped = 0  # operations not attempted while open / half-open
        self.probes = 0
        self.probe_failures = 0

    def allow(self) -> bool:
        """Whether an operation may be attempted now (a skip is counted)."""
        if self.state == CLOSED:
            return True
        self.skipped += 1
        return False

    def record_success(self) -> None:
        if self.state == CLOSED:
            self.consecutive_failures = 0

    def record_failure(self) -> None:
        if self.state != CLOSED:
            return
        self.consecutive_failures += 1
        if self.consecutive_failures >= self.threshold:
            self.state = OPEN
            self.trips += 1
            self.backoff = self.base_backoff
            self.retry_at = self.clock() + self.backoff

    def begin_probe(self) -> bool:
        """True (and half-open) when the circuit is open and its backoff has passed."""
        if self.state != OPEN or self.clock() < self.retry_at:
            return False
        self.state = HALF_OPEN
        self.probes += 1
        return True

    def end_probe(self, ok: bool) -> None:
        if self.state != HALF_OPEN:
            return
        if ok:
            self.state = CLOSED
            self.consecutive_failures = 0
            self.backoff = self.base_backoff
            self.recoveries += 1
        else:
            self.probe_failures += 1
            self.state = OPEN
            self.backoff = min(self.backoff * 2, self.max_backoff)
            self.retry_at = self.clock() + self.backoff

    def force_open(self) -> None:
        """Open now (e.g. the first connection failed at start)."""
        if self.state == CLOSED:
            self.consecutive_failures = self.threshold - 1
            self.record_failure()
