"""Recent requests for the dashboard: a bounded ring; ``summary()`` gives hit rates, TTFT
with and without cached tokens, tokens and estimated seconds saved, the busiest sessions."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

DEFAULT_CAPACITY = 500
TOP = 5


@dataclass(frozen=True)
class RequestSample:
    at: float  # wall-clock seconds
    api: str
    tenant: str
    session: str | None
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float | None
    cause: str | None
    rolling_hit_rate: float | None

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _mean(values: Iterable[float]) -> float | None:
    vals = list(values)
    return sum(vals) / len(vals) if vals else None


def _busiest(samples: Iterable[RequestSample], key: Callable[[RequestSample], str | None]
             ) -> list[dict[str, Any]]:
    agg: dict[str, list[int]] = {}
    for s in samples:
        k = key(s)
        if k is None:
            continue
        a = agg.setdefault(k, [0, 0, 0])
        a[0] += 1
        a[1] += s.prompt_tokens
        a[2] += s.cached_tokens
    rows = sorted(agg.items(), key=lambda kv: (-kv[1][1], -kv[1][0], kv[0]))[:TOP]
    return [{"id": k, "requests": r, "prompt_tokens": p, "cached_tokens": c,
             "hit_rate": c / p if p else 0.0} for k, (r, p, c) in rows]


class RequestHistory:
    """Thread-safe ring of the last ``capacity`` finished requests plus running totals."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY,
                 clock: Callable[[], float] = time.time) -> None:
        if capacity < 1:
            raise ValueError(f"history capacity must be >= 1, got {capacity}")
        self._ring: deque[RequestSample] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._clock = clock
        self.num_requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def record(self, *, api: str, tenant: str, session: str | None, prompt_tokens: int,
               cached_tokens: int, ttft_s: float | None, cause: str | None,
               rolling_hit_rate: float | None) -> None:
        s = RequestSample(self._clock(), api, tenant, session, int(prompt_tokens),
                          int(cached_tokens), ttft_s, cause, rolling_hit_rate)
        with self._lock:
            self._ring.append(s)
            self.num_requests += 1
            self.prompt_tokens += s.prompt_tokens
            self.cached_tokens += s.cached_tokens

    def samples(self) -> list[RequestSample]:
        with self._lock:
            return list(self._ring)

    def summary(self, tenant: str | None = None, points: int = 200) -> dict[str, Any]:
        """What the dashboard shows; ``tenant``: that tenant's requests only."""
        with self._lock:
            ring = [s for s in self._ring if tenant is None or s.tenant == tenant]
            totals = (self.num_requests, self.prompt_tokens, self.cached_tokens)
        if tenant is not None:
            totals = (len(ring), sum(s.prompt_tokens for s in ring),
                      sum(s.cached_tokens for s in ring))
        cached = [s for s in ring if s.cached_tokens > 0]
        uncached = [s for s in ring if s.cached_tokens == 0]
        per_token = _mean(s.ttft_s / s.prompt_tokens for s in uncached
                          if s.ttft_s is not None and s.ttft_s > 0 and s.prompt_tokens > 0)
        window_cached = sum(s.cached_tokens for s in ring)
        return {
            "requests": totals[0],
            "prompt_tokens": totals[1],
            "cached_tokens": totals[2],
            "window_requests": len(ring),
            "tokens_saved": window_cached,
            "seconds_saved_estimate": None if per_token is None else window_cached * per_token,
            "ttft_cached_s": _mean(s.ttft_s for s in cached if s.ttft_s is not None),
            "ttft_uncached_s": _mean(s.ttft_s for s in uncached if s.ttft_s is not None),
            "ttft_cached_requests": len(cached),
            "ttft_uncached_requests": len(uncached),
            "series": [{"at": s.at, "hit_rate": s.hit_rate, "rolling": s.rolling_hit_rate,
                        "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens}
                       for s in ring[-points:]],
            "busiest_sessions": _busiest(ring, lambda s: s.session),
            "busiest_tenants": _busiest(ring, lambda s: s.tenant),
        }
