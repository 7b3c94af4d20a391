"""``--auto-tune``: move the RAM budget within ``[min, max]``, logging every change: shrink under
memory pressure, grow toward the advisor's budget when early evictions cost ``grow_miss_rate``."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


def system_memory() -> Any:
    import psutil  # type: ignore[import-untyped]

    return psutil.virtual_memory()


@dataclass(frozen=True)
class Change:
    old_bytes: int
    new_bytes: int
    reason: str


class AutoTuner:
    def __init__(self, cache: Any, advisor: Any, *, min_bytes: int, max_bytes: int,
                 memory: Callable[[], Any] = system_memory, interval_s: float = 10.0,
                 pressure_fraction: float = 0.10, shrink_step: float = 0.25,
                 grow_miss_rate: float = 0.02) -> None:
        if not 0 <= min_bytes <= max_bytes:
            raise ValueError(f"auto-tune bounds must satisfy 0 <= min <= max, got "
                             f"[{min_bytes}, {max_bytes}]")
        if not 0 < shrink_step < 1 or not 0 <= pressure_fraction < 1:
            raise ValueError("shrink_step must be in (0, 1) and pressure_fraction in [0, 1)")
        self.cache, self.advisor = cache, advisor
        self.min_bytes, self.max_bytes = int(min_bytes), int(max_bytes)
        self.memory = memory
        self.interval_s = interval_s
        self.pressure_fraction = pressure_fraction
        self.shrink_step = shrink_step
        self.grow_miss_rate = grow_miss_rate
        self.changes: list[Change] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        budget = self.budget
        if not self.min_bytes <= budget <= self.max_bytes:
            self._apply(budget, min(self.max_bytes, max(self.min_bytes, budget)),
                        "the budget at start is outside the auto-tune bounds")

    @property
    def budget(self) -> int:
        return int(self.cache.pool.budget_bytes)

    def _apply(self, old: int, target: int, reason: str) -> int | None:
        target = min(self.max_bytes, max(self.min_bytes, int(target)))
        if target == old:
            return None
        new = int(self.cache.resize_ram(target))
        if new == old:
            return None
        self.changes.append(Change(old, new, reason))
        log.info("auto-tune: RAM budget %d -> %d bytes (%.1f -> %.1f MB): %s", old, new,
                 old / 2**20, new / 2**20, reason)
        return new

    def step(self) -> int | None:
        """One decision; returns the new budget, or None when it stays."""
        with self._lock:
            mem = self.memory()
            total, available = int(mem.total), int(mem.available)
            old = self.budget
            floor = int(self.pressure_fraction * total)
            if available < floor:
                return self._apply(old, int(old * (1 - self.shrink_step)),
                                   f"memory pressure: {available / 2**20:.0f} MB of "
                                   f"{total / 2**20:.0f} MB available")
            want = self.advisor.recommended_budget()
            rate = self.advisor.eviction_miss_rate()
            if want is None or want <= old or rate < self.grow_miss_rate:
                return None
            target = min(want, old + max(0, available - floor))
            return self._apply(old, target, f"{rate * 100:.1f}% of prompt tokens were lost "
                                            f"to blocks evicted before reuse; {want / 2**20:.1f} "
                                            "MB would have kept them")

    def snapshot(self) -> dict[str, Any]:
        return {"ram_budget_bytes": self.budget, "min_bytes": self.min_bytes,
                "max_bytes": self.max_bytes, "changes": len(self.changes),
                "last_change": (None if not self.changes else
                                {"old": self.changes[-1].old_bytes, "new":
                                 self.changes[-1].new_bytes, "reason": self.changes[-1].reason})}

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="promptcache-auto-tune",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.step()
            except Exception:
                log.exception("auto-tune step failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
