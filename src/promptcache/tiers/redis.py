"""The shared Redis / Valkey tier (standalone or Cluster): the ``Tier`` facade over ``redis_keys``,
``redis_client``, ``redis_queue``, ``redis_reads``, ``redis_writes`` and ``redis_delete``.

Fail open: any fault ends as a counted miss, never an error or a stall. TTL is set at every write;
reads do not extend it."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from ..config import RedisConfig
from ..errors import CorruptBlockError, TierError
from ..hashing import BlockHash
from ..meta import BlockMeta, Namespace
from .base import PayloadSource
from .redis_client import Remote, Tally
from .redis_delete import Deleter
from .redis_keys import KeySpace
from .redis_queue import STOP, WriteQueue
from .redis_reads import Reads
from .redis_writes import Writer

log = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])


def _boundary(fn: _F) -> _F:
    """The tier boundary: anything but TierError / ValueError is logged, counted, re-raised."""

    @functools.wraps(fn)
    def wrapper(self: RedisTier, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except (TierError, ValueError):
            raise
        except Exception as e:
            log.exception("redis %s: unexpected error", fn.__name__)
            self.tally.add("unexpected_errors")
            raise TierError(f"redis {fn.__name__} failed unexpectedly: {e!r}") from e

    return wrapper  # type: ignore[return-value]


class RedisTier:
    """``clock`` drives the circuit breaker; ``start_threads=False``: no prober (tests)."""

    name = "redis"

    def __init__(
        self,
        config: RedisConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        start_prober: bool = True,
    ) -> None:
        if not isinstance(config, RedisConfig):
            raise ValueError(f"config must be a RedisConfig, got {type(config).__name__}")
        self.policy = config.policy
        self.keys = KeySpace(config.prefix)
        self.remote = Remote(config, clock=clock, start_prober=start_prober)
        self.tally = Tally(self.remote.lock)
        self.writes = WriteQueue(config, self.remote.lock, lambda: self.remote.healthy)
        ttl = max(1, int(round(config.ttl_seconds)))
        self.writer = Writer(self.remote, self.keys, self.writes, self.tally, ttl)
        self.reads = Reads(self.remote, self.keys, self.writes, self.tally)
        self.deleter = Deleter(self.remote, self.keys, self.writes, self.tally, self.writer.lock)
        self._write_lock, self._queue, self._pending = (
            self.writer.lock, self.writes.queue, self.writes.pending)
        self._thread = threading.Thread(target=self.writer.run,
                                        name="promptcache-redis-writer", daemon=True)
        self._thread.start()

    @property
    def config(self) -> RedisConfig:
        """The configuration in use (the queue's limits follow a replaced one)."""
        return self.writes.config

    @config.setter
    def config(self, config: RedisConfig) -> None:
        self.writes.config = config

    @_boundary
    def get_meta(self, block_hash: BlockHash, *, ns: Namespace | None = None) -> BlockMeta | None:
        return self.reads.get_metas([bytes(block_hash)], ns)[0]

    @_boundary
    def get_metas(self, block_hashes: Sequence[BlockHash], *, ns: Namespace | None = None
                  ) -> list[BlockMeta | None]:
        """Metadata of many blocks in one round trip (None where absent or damaged)."""
        return self.reads.get_metas([bytes(h) for h in block_hashes], ns)

    @_boundary
    def children(self, parent_hash: BlockHash, *, ns: Namespace | None = None) -> list[BlockMeta]:
        return self.reads.children(bytes(parent_hash), ns)

    @_boundary
    def sessions_of(self, block_hash: BlockHash, *, ns: Namespace | None = None) -> list[str]:
        return self.reads.sessions_of(bytes(block_hash), ns)

    @_boundary
    def get(self, block_hash: BlockHash, *, ns: Namespace | None = None) -> bytes | None:
        got = self.reads.fetch([bytes(block_hash)], ns)[0]
        if isinstance(got, CorruptBlockError):
            raise got
        return None if got is None else got[0]

    @_boundary
    def get_many(self, block_hashes: Sequence[BlockHash], *, ns: Namespace | None = None
                 ) -> list[tuple[bytes, list[str]] | None]:
        """``(payload, sessions)`` of many blocks in one round trip (None: absent or damaged)."""
        return [g if isinstance(g, tuple) else None
                for g in self.reads.fetch([bytes(h) for h in block_hashes], ns)]

    @_boundary
    def put(self, meta: BlockMeta, payload: bytes | PayloadSource, sessions: Iterable[str] = (),
            hits: int | None = None, *, timeout: float | None = 0.0) -> bool:
        """Queue a block for writing; False if refused (counted by reason)."""
        return self.writes.put(meta, payload, sessions, timeout)

    @_boundary
    def has_room(self, timeout: float | None = 0.0) -> bool:
        """Whether a non-waiting put would find queue room now (waiting up to ``timeout``)."""
        return self.writes.has_room(timeout)

    @_boundary
    def add_sessions(self, block_hash: BlockHash, sessions: Iterable[str], *,
                     ns: Namespace | None = None) -> None:
        self.writes.add_sessions(bytes(block_hash), sessions, ns)

    @_boundary
    def discard(self, block_hashes: Iterable[BlockHash], *, ns: Namespace | None = None) -> int:
        """Delete these blocks asynchronously; returns how many were queued or cancelled."""
        return self.writes.discard((bytes(h) for h in block_hashes), ns)

    @_boundary
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write was sent or dropped; True if within ``timeout``."""
        return self.writes.flush(timeout)

    @_boundary
    def delete_session(self, session_id: str, tenant: str | None = None) -> int:
        return len(self.deleter.delete_session(session_id, tenant))

    @_boundary
    def delete_session_blocks(self, session_id: str, tenant: str | None = None
                              ) -> set[bytes]:
        return self.deleter.delete_session(session_id, tenant)

    @_boundary
    def delete_tenant(self, tenant: str | None) -> int:
        return self.deleter.delete_tenant(tenant)

    def probe(self) -> bool | None:
        """Run a health probe now if one is due (the prober thread does this)."""
        return self.remote.probe()

    @property
    def healthy(self) -> bool:
        return self.remote.healthy

    def health(self) -> dict[str, Any]:
        """Cheap (no I/O): whether the circuit is closed, and the last error if not."""
        remote = self.remote
        return {"healthy": remote.healthy, "state": remote.breaker.state,
                "reason": None if remote.healthy else remote.last_error}

    def check_reachable(self) -> bool:
        """One ping at startup; False: unreachable (skipped until a probe succeeds)."""
        return self.remote.check_reachable()

    def stats(self) -> dict[str, Any]:
        out = {"name": self.name, "policy": self.policy, **self.remote.stats()}
        with self.remote.lock:
            c, drops, q = self.tally.counts, self.writes.drops, self.writes.queue
            out.update({k: c[k] for k in (
                "hits", "misses", "pending_hits", "meta_lookups", "meta_found", "corrupt",
                "stale_children", "bytes_read", "writes", "bytes_written", "sessions_added",
                "discarded", "deleted_blocks", "unexpected_errors")})
            out.update({
                "dropped_writes_by_reason": dict(drops),
                "dropped_writes_total": sum(drops.values()),
                "queue_depth": q.qsize(),
                "pending_writes": q.unfinished_tasks,
                "ttl_seconds": self.writer.ttl,
            })
        return out

    def close(self) -> None:
        """Send what is queued (unless the circuit is open), then stop the threads."""
        if not self.writes.close():
            return
        self.writes.queue.put(STOP)
        self._thread.join()
        self.remote.close()

    def __enter__(self) -> RedisTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
