"""Rolling reuse rate over the last N requests that repeat earlier traffic (``new`` and
``off`` not counted) and the low-hit-rate alert (after ``min_samples``; logs the common
miss reasons once per window)."""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .outcome import Outcome

log = logging.getLogger(__name__)


@dataclass
class _Sample:
    shared: int
    reused: int
    cause: str | None


class HitRateMonitor:
    def __init__(self, window: int = 50, threshold: float = 0.8,
                 min_samples: int | None = None) -> None:
        if window < 1:
            raise ValueError(f"hit-rate window must be >= 1, got {window}")
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"hit-rate threshold must be in [0, 1], got {threshold}")
        self.window = window
        self.threshold = threshold
        self.min_samples = min(window, 10) if min_samples is None else min_samples
        self._samples: deque[_Sample] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.alerting = False
        self.num_skipped_new = 0
        self._since_warning = 0
        # the diagnosis added to the warning, from missed tokens by cause (advisor.py)
        self.explain: Callable[[dict[str, int]], str | None] | None = None

    def record(self, outcome: Outcome) -> None:
        with self._lock:
            if not outcome.counted:
                if outcome.word != "off":
                    self.num_skipped_new += 1
                return
            self._samples.append(_Sample(outcome.shared, min(outcome.reused, outcome.shared),
                                         outcome.cause))
            self._evaluate()

    def _rate_locked(self) -> float | None:
        shared = sum(s.shared for s in self._samples)
        if shared == 0:
            return None
        return sum(s.reused for s in self._samples) / shared

    def _reasons_locked(self, top: int = 3) -> list[tuple[str, int]]:
        c = Counter(s.cause for s in self._samples if s.cause is not None)
        return c.most_common(top)

    def _missed_locked(self) -> dict[str, int]:
        missed: Counter[str] = Counter()
        for s in self._samples:
            if s.cause is not None and s.shared > s.reused:
                missed[s.cause] += s.shared - s.reused
        return dict(missed)

    def missed_by_cause(self) -> dict[str, int]:
        """Tokens the window's counted misses did not reuse, by cause."""
        with self._lock:
            return self._missed_locked()

    def _evaluate(self) -> None:
        rate = self._rate_locked()
        if rate is None or len(self._samples) < self.min_samples:
            return
        low = rate < self.threshold
        self._since_warning += 1
        if low and (not self.alerting or self._since_warning >= self.window):
            reasons = ", ".join(f"{r} x{n}" for r, n in self._reasons_locked()) or "none recorded"
            diagnosis = None
            if self.explain is not None:
                try:
                    diagnosis = self.explain(self._missed_locked())
                except Exception:
                    log.debug("hit-rate diagnosis failed", exc_info=True)
            log.warning(
                "low prompt-cache hit rate: %.1f%% of the tokens %d requests repeat from "
                "earlier traffic were reused (threshold %.0f%%); most common miss reasons: "
                "%s%s", rate * 100, len(self._samples), self.threshold * 100, reasons,
                f"; diagnosis: {diagnosis}" if diagnosis else "")
            self._since_warning = 0
        elif not low and self.alerting:
            log.info("prompt-cache hit rate recovered: %.1f%%", rate * 100)
        self.alerting = low

    def hit_rate(self) -> float | None:
        with self._lock:
            return self._rate_locked()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "window": self.window,
                "threshold": self.threshold,
                "requests_in_window": len(self._samples),
                "skipped_new_prompts": self.num_skipped_new,
                "shared_tokens": sum(s.shared for s in self._samples),
                "reused_tokens": sum(s.reused for s in self._samples),
                "hit_rate": self._rate_locked(),
                "alerting": self.alerting,
                "top_miss_reasons": dict(self._reasons_locked(5)),
            }
