"""Session TTL (``--session-ttl``): delete the sessions nobody used for ``ttl`` seconds, by what
this process saw and what tiers report (pre-restart sessions expire too).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger(__name__)


class SessionStore(Protocol):
    """What the reaper uses of a cache (``PromptCache``; ``engine/port.CacheAPI``)."""

    def sessions(self, tenant: str | None = None) -> list[dict[str, Any]]: ...

    def delete_session(self, session_id: str, tenant: str | None = None) -> int: ...


class SessionReaper:
    def __init__(self, cache: SessionStore, ttl_s: float, *, clock: Callable[[], float] = time.time,
                 interval_s: float | None = None) -> None:
        if not ttl_s > 0:
            raise ValueError(f"session ttl must be > 0 seconds, got {ttl_s!r}")
        self.cache = cache
        self.ttl_s = float(ttl_s)
        self.interval_s = interval_s if interval_s is not None else min(self.ttl_s / 4, 60.0)
        self._clock = clock
        self._seen: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_reaped = 0
        self.blocks_reaped = 0

    def touch(self, tenant: str, session_id: str | None) -> None:
        if session_id:
            with self._lock:
                self._seen[(tenant, session_id)] = self._clock()

    def last_use(self, tenant: str, session_id: str) -> float | None:
        with self._lock:
            return self._seen.get((tenant, session_id))

    def idle(self) -> list[tuple[str, str, float]]:
        """``(tenant, session, last use)`` of every session idle past the TTL."""
        now = self._clock()
        with self._lock:
            last = dict(self._seen)
        for row in self.cache.sessions():
            key = (row["tenant"], row["session_id"])
            stored = [t["last_use"] for t in row["tiers"].values() if "last_use" in t]
            best = max([*stored, *([last[key]] if key in last else [])], default=None)
            if best is None:  # only in RAM and never seen by this process: start now
                with self._lock:
                    self._seen.setdefault(key, now)
                continue
            last[key] = best
        return sorted((t, s, when) for (t, s), when in last.items() if now - when > self.ttl_s)

    def sweep(self) -> int:
        """Delete the idle sessions; returns how many were deleted."""
        done = 0
        for tenant, session, when in self.idle():
            with self._lock:  # used again since idle() looked: keep it
                seen = self._seen.get((tenant, session))
                if seen is not None and self._clock() - seen <= self.ttl_s:
                    continue
                self._seen.pop((tenant, session), None)
            n = int(self.cache.delete_session(session, tenant))
            done += 1
            self.num_reaped += 1
            self.blocks_reaped += n
            log.info("session %s (tenant %s) unused for %.0f s: deleted %d blocks", session,
                     tenant, self._clock() - when, n)
        return done

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            tracked = len(self._seen)
        return {"ttl_s": self.ttl_s, "tracked": tracked, "reaped_sessions": self.num_reaped,
                "reaped_blocks": self.blocks_reaped}

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="promptcache-session-ttl",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sweep()
            except Exception:
                log.exception("session TTL sweep failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
