"""Rolling token hit rate over the last N requests, and the low-hit-rate alert.

Rule for cold starts: a request that hit nothing and whose miss reason is ``cold``
(its prefix was never seen: the first turn of a new conversation) is *not* counted:
a cache cannot be expected to hit it. Every other request counts with its prompt and
cached tokens, including requests served with the cache disabled.

The alert is evaluated once the window holds at least ``min_samples`` counted
requests (``min(window, 10)`` by default). Entering the alert state logs a warning with
the most common miss reasons in the window; while it lasts the warning is repeated
once per ``window`` requests; leaving it logs an info line.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...engine.api import CacheMiss

log = logging.getLogger(__name__)

@dataclass
class _Sample:
    prompt_tokens: int
    cached_tokens: int
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
        self.num_skipped_cold = 0
        self._since_warning = 0
        # the automated diagnosis added to the warning (the app sets it: advisor.py)
        self.explain: Callable[[], str | None] | None = None

    def record(self, prompt_tokens: int, cached_tokens: int, miss: CacheMiss | None) -> None:
        cause = miss.cause if miss is not None else None
        with self._lock:
            if cached_tokens == 0 and cause == "cold":
                self.num_skipped_cold += 1
                return
            self._samples.append(_Sample(prompt_tokens, cached_tokens, cause))
            self._evaluate()

    def _rate_locked(self) -> float | None:
        prompt = sum(s.prompt_tokens for s in self._samples)
        if prompt == 0:
            return None
        return sum(s.cached_tokens for s in self._samples) / prompt

    def _reasons_locked(self, top: int = 3) -> list[tuple[str, int]]:
        c = Counter(s.cause for s in self._samples if s.cause is not None)
        return c.most_common(top)

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
                    diagnosis = self.explain()
                except Exception:
                    log.debug("hit-rate diagnosis failed", exc_info=True)
            log.warning(
                "low prompt-cache hit rate: %.1f%% over the last %d requests (threshold %.0f%%); "
                "most common miss reasons: %s%s", rate * 100, len(self._samples),
                self.threshold * 100, reasons, f"; diagnosis: {diagnosis}" if diagnosis else "")
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
                "skipped_cold_starts": self.num_skipped_cold,
                "prompt_tokens": sum(s.prompt_tokens for s in self._samples),
                "cached_tokens": sum(s.cached_tokens for s in self._samples),
                "hit_rate": self._rate_locked(),
                "alerting": self.alerting,
                "top_miss_reasons": dict(self._reasons_locked(5)),
            }
