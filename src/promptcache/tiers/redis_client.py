"""The Redis tier's connection side: clients, fail-fast calls, the circuit breaker, the prober.

A read client (short timeout) and a write client (longer) share one breaker; redis-py retries are
off (a retry is a stall). OOM and command errors do not open the circuit. While open, the prober
pings after a doubling backoff."""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import (
    ConnectionError as RedisConnectionError,
)
from redis.exceptions import (
    DataError,
    OutOfMemoryError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.exceptions import (
    TimeoutError as RedisTimeoutError,
)
from redis.retry import Retry

from ..config import RedisConfig
from ..errors import TierError

log = logging.getLogger(__name__)

T = TypeVar("T")
CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"
LATENCY_BUCKETS_MS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 250.0, 1000.0)
# the writer thread and admin calls: sending a batch of large values takes longer
MIN_WRITE_TIMEOUT_S = 2.0
Client = Any  # redis.Redis | RedisCluster (both untyped enough that Any is honest)

class CircuitBreaker:
    """closed -> open -> half_open -> closed | open (see the module docstring)."""

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

    def trip(self) -> None:
        """Open the circuit now (the tier was found unreachable): probes follow."""
        if self.state == CLOSED:
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


class Skipped(TierError):
    """The circuit is open: the operation was not attempted."""


def redact(url: str) -> str:
    """The URL without its password (for logs and stats)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))


def make_client(config: RedisConfig, timeout_s: float) -> Client:
    """A redis-py client for ``config.url`` without retries (a cluster one connects here)."""
    url = config.url.replace("+cluster://", "://", 1)
    opts: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": config.connect_timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
    }
    if config.is_cluster:
        if url.startswith("unix://"):
            raise ValueError("a Redis Cluster is reached over TCP (redis:// or rediss://)")
        return RedisCluster.from_url(url, **opts)
    return redis.Redis.from_url(url, **opts)


class Tally:
    """Counters under a lock shared with the other parts of the tier."""

    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock
        self.counts: Counter[str] = Counter()

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n


class Remote:
    """Clients + breaker + counters + prober (see the module docstring)."""

    def __init__(
        self,
        config: RedisConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        start_prober: bool = True,
    ) -> None:
        self.config = config
        self.lock = threading.RLock()
        self.breaker = CircuitBreaker(
            failures=config.breaker_failures, backoff_s=config.breaker_backoff_s,
            max_backoff_s=config.breaker_max_backoff_s, clock=clock,
        )
        self.counts: Counter[str] = Counter()
        self.latency = [0] * (len(LATENCY_BUCKETS_MS) + 1)
        self.latency_sum_ms = 0.0
        self.last_error: str | None = None
        self._clients: dict[str, Client] = {}
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None
        if start_prober:
            self._prober = threading.Thread(target=self._probe_loop, name="promptcache-redis-probe",
                                            daemon=True)
            self._prober.start()

    def client(self, kind: str) -> Client:
        """The ``read`` or ``write`` client, created on first use."""
        with self.lock:
            c = self._clients.get(kind)
        if c is not None:
            return c
        timeout = self.config.timeout_s
        if kind == "write":
            timeout = max(timeout, MIN_WRITE_TIMEOUT_S)
        try:
            c = make_client(self.config, timeout)
        except (RedisError, RedisClusterException, OSError) as e:
            raise RedisConnectionError(f"cannot connect: {e}") from e
        with self.lock:
            return self._clients.setdefault(kind, c)

    def _drop_clients(self) -> None:
        with self.lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            try:
                c.close()
            except Exception:  # closing a broken client must not raise
                log.debug("closing a redis client failed", exc_info=True)

    def call(self, what: str, fn: Callable[[Client], T], *, kind: str = "read") -> T:
        """Run ``fn(client)`` fail-fast; raises ``Skipped`` or ``TierError``."""
        with self.lock:
            if not self.breaker.allow():
                self.counts["skipped"] += 1
                raise Skipped(f"redis {what}: circuit open")
        t0 = time.perf_counter()
        try:
            result = fn(self.client(kind))
        except OutOfMemoryError as e:
            self._failed("oom_errors", what, e, trip=False)
        except RedisTimeoutError as e:
            self._failed("timeouts", what, e, trip=True)
        except (RedisConnectionError, RedisClusterException, OSError) as e:
            self._failed("connection_errors", what, e, trip=True)
        except (ResponseError, DataError) as e:
            from redis.exceptions import ClusterError, ReadOnlyError

            trip = isinstance(e, ClusterError | ReadOnlyError)
            self._failed("unavailable_errors" if trip else "command_errors", what, e, trip=trip)
        except RedisError as e:
            self._failed("connection_errors", what, e, trip=True)
        ms = (time.perf_counter() - t0) * 1000.0
        with self.lock:
            self.breaker.record_success()
            self.counts["round_trips"] += 1
            self.latency[bisect.bisect_left(LATENCY_BUCKETS_MS, ms)] += 1
            self.latency_sum_ms += ms
        return result

    def _failed(self, counter: str, what: str, e: BaseException, *, trip: bool) -> Any:
        with self.lock:
            self.counts[counter] += 1
            self.counts["errors"] += 1
            self.last_error = f"{what}: {type(e).__name__}: {e}"
            if trip:
                was = self.breaker.state
                self.breaker.record_failure()
                if was == CLOSED and self.breaker.state != CLOSED:
                    log.warning("redis tier unavailable (%s); circuit open for %.1fs",
                                self.last_error, self.breaker.backoff)
        raise TierError(f"redis {what} failed: {type(e).__name__}: {e}") from e

    def probe(self) -> bool | None:
        """One health probe if due (None if not); on the prober thread."""
        with self.lock:
            if not self.breaker.begin_probe():
                return None
        self._drop_clients()  # a fresh connection (and cluster topology) for the probe
        ok = True
        try:
            self._ping()
        except (RedisError, RedisClusterException, OSError) as e:
            ok = False
            with self.lock:
                self.last_error = f"probe: {type(e).__name__}: {e}"
        with self.lock:
            self.breaker.end_probe(ok)
            if ok:
                log.info("redis tier reachable again; circuit closed")
            else:
                log.debug("redis probe failed; next in %.1fs", self.breaker.backoff)
        return ok

    def _ping(self) -> None:
        """One PING (every primary of a cluster); raises what redis-py raises."""
        c = self.client("read")
        if isinstance(c, RedisCluster):
            c.ping(target_nodes=RedisCluster.PRIMARIES)
        else:
            c.ping()

    def check_reachable(self) -> bool:
        """One ping at startup; False when the server does not answer (the prober retries)."""
        try:
            self._ping()
        except (RedisError, RedisClusterException, OSError) as e:
            with self.lock:
                self.counts["timeouts" if isinstance(e, RedisTimeoutError)
                            else "connection_errors"] += 1
                self.counts["errors"] += 1
                self.last_error = f"startup: {type(e).__name__}: {e}"
                self.breaker.trip()
            self._drop_clients()
            return False
        return True

    def _probe_loop(self) -> None:
        while not self._stop.wait(self.config.probe_interval_s):
            try:
                self.probe()
            except Exception:  # the prober must survive anything
                log.exception("redis prober: unexpected error")

    @property
    def healthy(self) -> bool:
        return self.breaker.state == CLOSED

    def stats(self) -> dict[str, Any]:
        with self.lock:
            b, c = self.breaker, self.counts
            return {
                "url": redact(self.config.url),
                "cluster": self.config.is_cluster,
                "state": b.state,
                "healthy": b.state == CLOSED,
                "breaker_trips": b.trips,
                "breaker_recoveries": b.recoveries,
                "breaker_backoff_s": b.backoff,
                "probes": b.probes,
                "probe_failures": b.probe_failures,
                "skipped_ops": c["skipped"],
                "round_trips": c["round_trips"],
                "errors": c["errors"],
                "timeouts": c["timeouts"],
                "connection_errors": c["connection_errors"],
                "unavailable_errors": c["unavailable_errors"],
                "oom_errors": c["oom_errors"],
                "command_errors": c["command_errors"],
                "last_error": self.last_error,
                "latency_ms": {
                    "buckets": list(LATENCY_BUCKETS_MS),
                    "counts": list(self.latency),
                    "count": sum(self.latency),
                    "sum": round(self.latency_sum_ms, 3),
                },
            }

    def close(self) -> None:
        self._stop.set()
        if self._prober is not None:
            self._prober.join()
        self._drop_clients()
