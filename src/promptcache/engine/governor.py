"""The memory governor: one memory limit on the process's real footprint (on a Mac, running out of
unified memory panics the kernel). Past the soft watermark MLX's buffer pool, live states and the
RAM tier release, in that order, and new requests wait; past the hard one they get a Retry-After."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

OK, PAUSE, REFUSE = "ok", "pause", "refuse"
# the RAM tier's budget grows back once the footprint is this far under the soft mark
REGROW_MARGIN = 0.05
MAX_RETRY_AFTER_S = 600


@dataclass(frozen=True)
class Holder:
    """A part that can give memory back: ``release(nbytes)`` (inf: all) returns bytes freed."""

    name: str
    release: Callable[[float], int]


@dataclass
class GovernorStats:
    checks: int = 0
    reclaims: int = 0  # checks that found the footprint past the soft watermark
    released: dict[str, int] = field(default_factory=dict)  # bytes, per holder
    paused: int = 0  # checks that left admission paused
    refused: int = 0  # checks that left admission refusing new work
    peak_footprint: int = 0
    refused_peaks: int = 0  # requests refused at submit: their peak would not fit now


@dataclass(frozen=True)
class Decision:
    """What one check saw and did."""

    footprint: int  # before the releases
    after: int  # the footprint read again after them
    released: tuple[tuple[str, int], ...]  # (holder, bytes) in the order asked
    level: str  # OK | PAUSE | REFUSE
    retry_after_s: int


class MemoryGovernor:
    """Enforces ``limit`` bytes on ``footprint()`` (see the module docstring)."""

    def __init__(self, limit: int, footprint: Callable[[], int],
                 holders: Sequence[Holder], *, pool: Holder | None = None,
                 admission: Callable[[str, int], None] = lambda level, retry: None,
                 regrow: Callable[[], None] = lambda: None,
                 soft: float = 0.85, hard: float = 0.95, interval_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if limit <= 0:
            raise ValueError(f"the memory limit must be > 0 bytes, got {limit}")
        if not 0 < soft <= hard <= 1:
            raise ValueError(f"watermarks must satisfy 0 < soft <= hard <= 1, got "
                             f"{soft} / {hard}")
        self.limit = limit
        self.soft = int(limit * soft)
        self.hard = int(limit * hard)
        self._footprint = footprint
        self._holders = list(holders)
        self._pool = pool
        self._admission = admission
        self._regrow = regrow
        self._interval = interval_s
        self._clock = clock
        self._last = -math.inf
        self.level = OK
        self.stats = GovernorStats()
        # (time, footprint) of the last checks: the drain rate for Retry-After
        self._history: list[tuple[float, int]] = []

    @property
    def idle_wait_s(self) -> float | None:
        """How long an idle engine may wait: ``interval_s`` while admission is held, else always."""
        return self._interval if self.level != OK else None

    def maybe_check(self) -> Decision | None:
        """``check`` if ``interval_s`` passed since the last one."""
        now = self._clock()
        if now - self._last < self._interval:
            return None
        return self.check()

    def check(self) -> Decision:
        now = self._clock()
        self._last = now
        st = self.stats
        st.checks += 1
        used = int(self._footprint())
        st.peak_footprint = max(st.peak_footprint, used)
        released: list[tuple[str, int]] = []
        after = used
        if used > self.soft:
            st.reclaims += 1
            pool = self._pool
            if pool is not None:
                after = self._ask(pool, after, released)
            for holder in self._holders:
                if after <= self.soft:
                    break
                n = len(released)
                after = self._ask(holder, after, released)
                if pool is not None and len(released) > n and released[-1][1] \
                        and after > self.soft:
                    after = self._ask(pool, after, released)
        elif used < self.soft - self.limit * REGROW_MARGIN:
            self._regrow()
        self._history = [(t, f) for t, f in self._history if now - t <= 30.0]
        self._history.append((now, after))
        level = OK if after <= self.soft else PAUSE if after <= self.hard else REFUSE
        retry = self._retry_after(after) if level != OK else 0
        if level != self.level:
            logger.warning("memory: footprint %.2f GB of a %.2f GB limit (soft %.2f, hard "
                           "%.2f): admission %s", after / 1e9, self.limit / 1e9,
                           self.soft / 1e9, self.hard / 1e9, level)
        self.level = level
        st.paused += level == PAUSE
        st.refused += level == REFUSE
        self._admission(level, retry)
        return Decision(used, after, tuple(released), level, retry)

    def admit(self, peak: int, base: int, reclaimable: int, queue_retry_s: int = 1) -> None:
        """Whether a request of predicted ``peak`` may start: ``RequestError`` if it never fits,
        ``OverloadedError`` if not now."""
        from ..errors import OverloadedError, RequestError

        if base + peak > self.hard:
            raise RequestError(
                f"this request needs about {peak / 1e9:.2f} GB at its peak (KV, restore and "
                f"attention workspace) beside {base / 1e9:.2f} GB of weights: more than the "
                f"server's memory limit allows ({self.hard / 1e9:.2f} GB of "
                f"--memory-limit {self.limit / 1e9:.2f} GB); send a shorter prompt or fewer "
                f"max_tokens")
        now = self._history[-1][1] if self._history else base
        if max(base, now - reclaimable) + peak > self.hard:
            self.stats.refused_peaks += 1
            retry = self._retry_after(now) if now > self.soft else max(1, queue_retry_s)
            raise OverloadedError(
                f"this request needs about {peak / 1e9:.2f} GB at its peak; the server holds "
                f"{now / 1e9:.2f} GB of its {self.hard / 1e9:.2f} GB: retry in {retry}s",
                retry_after_s=retry)

    def fits(self, peak: int, base: int, reclaimable: int, running: int) -> bool:
        """Whether a queued ``peak`` fits now beside the ``running`` peaks, under the hard mark."""
        now = self._history[-1][1] if self._history else base
        return max(now - reclaimable, base + running) + peak <= self.hard

    def _ask(self, holder: Holder, used: int, released: list[tuple[str, int]]) -> int:
        """Ask ``holder`` for what ``used`` is over the soft mark; re-read the footprint after."""
        try:
            freed = int(holder.release(used - self.soft))
        except Exception:
            logger.exception("the memory governor's %s release failed", holder.name)
            return used
        released.append((holder.name, freed))
        st = self.stats
        st.released[holder.name] = st.released.get(holder.name, 0) + freed
        return int(self._footprint()) if freed else used

    def _retry_after(self, used: int) -> int:
        """Seconds until back under the soft mark at the last 30 s drain rate (1 s if none)."""
        if len(self._history) < 2:
            return 1
        (t0, f0), (t1, f1) = self._history[0], self._history[-1]
        rate = (f0 - f1) / (t1 - t0) if t1 > t0 else 0.0
        if rate <= 0:
            return 1
        return int(min(MAX_RETRY_AFTER_S, max(1, math.ceil((used - self.soft) / rate))))

    def snapshot(self) -> dict[str, object]:
        st = self.stats
        return {"memory_limit_bytes": self.limit, "memory_soft_bytes": self.soft,
                "memory_hard_bytes": self.hard, "memory_level": self.level,
                # the footprint the last check left (after its releases)
                "memory_footprint_bytes": self._history[-1][1] if self._history else 0,
                "memory_checks": st.checks, "memory_reclaims": st.reclaims,
                "memory_released_bytes": dict(st.released), "memory_paused": st.paused,
                "memory_refused": st.refused, "memory_peak_footprint": st.peak_footprint,
                "memory_refused_peaks": st.refused_peaks}



def trim_heap() -> bool:
    """glibc's ``malloc_trim(0)`` (freed memory stays in RSS until trimmed); True if any freed."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None).malloc_trim  # glibc (musl has none)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def process_footprint() -> int:
    """Physical footprint: macOS ``phys_footprint`` (Metal included), else RSS."""
    if sys.platform == "darwin":
        got = _darwin_phys_footprint()
        if got is not None:
            return got
    import psutil  # type: ignore[import-untyped]

    return int(psutil.Process().memory_info().rss)


class _RUsageInfoV2(ctypes.Structure):
    _fields_ = [("ri_uuid", ctypes.c_uint8 * 16), *[(n, ctypes.c_uint64) for n in (
        "ri_user_time", "ri_system_time", "ri_pkg_idle_wkups", "ri_interrupt_wkups",
        "ri_pageins", "ri_wired_size", "ri_resident_size", "ri_phys_footprint",
        "ri_proc_start_abstime", "ri_proc_exit_abstime", "ri_child_user_time",
        "ri_child_system_time", "ri_child_pkg_idle_wkups", "ri_child_interrupt_wkups",
        "ri_child_pageins", "ri_child_elapsed_abstime", "ri_diskio_bytesread",
        "ri_diskio_byteswritten")]]


def _darwin_phys_footprint() -> int | None:
    """``proc_pid_rusage(getpid(), RUSAGE_INFO_V2)``'s ``ri_phys_footprint``."""
    try:
        import os

        lib = ctypes.CDLL(ctypes.util.find_library("System") or "/usr/lib/libSystem.B.dylib")
        info = _RUsageInfoV2()
        if lib.proc_pid_rusage(os.getpid(), 2, ctypes.byref(info)) != 0:
            return None
        return int(info.ri_phys_footprint)
    except (OSError, AttributeError):
        return None
