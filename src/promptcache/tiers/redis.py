"""The shared Redis / Valkey tier (standalone or Cluster): several servers reuse
each other's blocks. This module is the facade (the ``Tier`` protocol, the tier's
shared state, stats and lifecycle); the work is done by: ``redis_keys`` (key layout
and records), ``redis_client`` (connections, timeouts, the circuit breaker and the
prober), ``redis_reads`` (the read path), ``redis_queue`` (the write queue),
``redis_writes`` (the writer thread's batches) and ``redis_delete`` (deletion by
session and tenant).

Fail open: every read is one pipelined round trip with a per-operation timeout (tens
of ms); any fault (down, slow, restarted, full, errors, a damaged value) ends as a
counted miss, never as an error or a stall of a request. Every public method lets
only ``TierError`` out (``tiers.base``; bad input raises ``ValueError``). Writes are
asynchronous: a bounded queue drained by one writer thread that pipelines whole
batches. ``put(..., timeout=0)`` (the request path) never waits: a full queue
refuses it (counted ``queue_full``; the cache keeps the block in RAM and offers it
again when ``has_room``); a positive or None ``timeout`` waits for room
(back-pressure). An open circuit or an oversized block refuses the put (counted).

Reads verify everything: the record must hash to its key (parent + tokens + extra
keys), the payload must have the recorded size and checksum; a damaged block is
deleted and counted (``corrupt``), and reads as a miss.

Namespaces: keys carry the tenant and the namespace key, so every method that names a
block by hash takes the namespace (``ns=``); without it the tier answers nothing.
TTL (``ttl_seconds``) is set on every key at every write (put, new session), so a
block written or reused by a server within the TTL stays; reads do not extend it.
Sessions and tenants: ``delete_session`` removes the session from its blocks (a block
left without sessions that had one is deleted); ``delete_tenant`` deletes every key
of the tenant (SCAN over each master). Payloads are bytes or a ``PayloadSource``
(``tiers.base``: encoded on the writer thread).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from ..config import RedisConfig
from ..errors import CorruptBlockError, TierError
from ..hashing import BlockHash
from ..meta import BlockMeta, Namespace
from . import redis_delete, redis_queue, redis_reads
from .base import PayloadSource
from .redis_client import Client, Remote
from .redis_keys import KeySpace
from .redis_queue import DROP_REASONS, STOP, Put
from .redis_writes import run_writer

log = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])


def _boundary(fn: _F) -> _F:
    """The tier boundary: only ``TierError`` (and ``ValueError`` for bad input) leaves
    a public method; anything else (a bug must not fail a request) is logged, counted
    (``unexpected_errors``) and raised as a ``TierError``."""

    @functools.wraps(fn)
    def wrapper(self: RedisTier, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except (TierError, ValueError):
            raise
        except Exception as e:
            log.exception("redis %s: unexpected error", fn.__name__)
            self._count("unexpected_errors")
            raise TierError(f"redis {fn.__name__} failed unexpectedly: {e!r}") from e

    return wrapper  # type: ignore[return-value]


class RedisTier:
    """See the module docstring. ``clock`` drives the circuit breaker (tests fake
    it); ``start_threads=False`` leaves the prober off (tests call ``probe()``)."""

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
        self.config = config
        self.policy = config.policy
        self.keys = KeySpace(config.prefix)
        self.remote = Remote(config, clock=clock, start_prober=start_prober)
        self._lock = self.remote.lock
        self._write_lock = threading.RLock()  # the writer's batches vs admin deletions
        self._ttl = max(1, int(round(config.ttl_seconds)))
        self._pending: dict[bytes, Put] = {}  # queued puts by hash (under _lock)
        self._counts: Counter[str] = Counter()
        self._drops: Counter[str] = Counter({r: 0 for r in DROP_REASONS})
        self._closed = False
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=config.queue_size)
        self._thread = threading.Thread(target=run_writer, args=(self,),
                                        name="promptcache-redis-writer", daemon=True)
        self._thread.start()

    # -- shared helpers (the parts call these) ------------------------------------------
    def _call(self, what: str, fn: Callable[[Client], Any], kind: str = "read") -> Any:
        return self.remote.call(what, fn, kind=kind)

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def _drop(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self._drops[reason] += n

    def _pending_for(self, h: bytes, ns: Namespace) -> Put | None:
        """The live pending put of ``h`` in namespace ``ns`` (caller holds ``_lock``)."""
        p = self._pending.get(h)
        if p is None or p.cancelled or p.meta.namespace_key != ns.key or p.meta.tenant != ns.tenant:
            return None
        return p

    # -- metadata queries (redis_reads) ---------------------------------------------------
    @_boundary
    def get_meta(self, block_hash: BlockHash, *, ns: Namespace | None = None) -> BlockMeta | None:
        return redis_reads.get_metas(self, [bytes(block_hash)], ns)[0]

    @_boundary
    def get_metas(self, block_hashes: Sequence[BlockHash], *, ns: Namespace | None = None
                  ) -> list[BlockMeta | None]:
        """Metadata of many blocks in one round trip (None where absent or damaged)."""
        return redis_reads.get_metas(self, [bytes(h) for h in block_hashes], ns)

    @_boundary
    def children(self, parent_hash: BlockHash, *, ns: Namespace | None = None) -> list[BlockMeta]:
        return redis_reads.children(self, bytes(parent_hash), ns)

    @_boundary
    def sessions_of(self, block_hash: BlockHash, *, ns: Namespace | None = None) -> list[str]:
        return redis_reads.sessions_of(self, bytes(block_hash), ns)

    # -- payload reads (redis_reads) ------------------------------------------------------
    @_boundary
    def get(self, block_hash: BlockHash, *, ns: Namespace | None = None) -> bytes | None:
        got = redis_reads.fetch(self, [bytes(block_hash)], ns)[0]
        if isinstance(got, CorruptBlockError):
            raise got
        return None if got is None else got[0]

    @_boundary
    def get_many(self, block_hashes: Sequence[BlockHash], *, ns: Namespace | None = None
                 ) -> list[tuple[bytes, list[str]] | None]:
        """``(payload, sessions)`` of many blocks in one round trip (None where absent
        or damaged: a damaged block is deleted and counted)."""
        return [g if isinstance(g, tuple) else None
                for g in redis_reads.fetch(self, [bytes(h) for h in block_hashes], ns)]

    # -- writes (queued: redis_queue; sent by the writer thread: redis_writes) -------------
    @_boundary
    def put(self, meta: BlockMeta, payload: bytes | PayloadSource, sessions: Iterable[str] = (),
            hits: int | None = None, *, timeout: float | None = 0.0) -> bool:
        """Queue a block for writing; False if refused (counted by reason).
        ``timeout``: how long to wait for room in a full queue (0: never wait, the
        request path; None: as long as it takes)."""
        return redis_queue.put(self, meta, payload, sessions, timeout)

    @_boundary
    def has_room(self, timeout: float | None = 0.0) -> bool:
        """Whether a put that does not wait would find room in the queue now (waiting
        up to ``timeout`` seconds for it; None: as long as it takes)."""
        return redis_queue.has_room(self, timeout)

    @_boundary
    def add_sessions(self, block_hash: BlockHash, sessions: Iterable[str], *,
                     ns: Namespace | None = None) -> None:
        redis_queue.add_sessions(self, bytes(block_hash), sessions, ns)

    @_boundary
    def discard(self, block_hashes: Iterable[BlockHash], *, ns: Namespace | None = None) -> int:
        """Delete these blocks (asynchronously, in queue order). Returns how many were
        queued or cancelled."""
        return redis_queue.discard(self, (bytes(h) for h in block_hashes), ns)

    @_boundary
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write was sent (or dropped). True if done within
        ``timeout`` seconds (None: no limit)."""
        return redis_queue.flush(self, timeout)

    # -- deletion (redis_delete) ----------------------------------------------------------
    @_boundary
    def delete_session(self, session_id: str, tenant: str | None = None) -> int:
        return redis_delete.delete_session(self, session_id, tenant)

    @_boundary
    def delete_tenant(self, tenant: str | None) -> int:
        return redis_delete.delete_tenant(self, tenant)

    # -- health, stats, lifecycle -------------------------------------------------------------
    def probe(self) -> bool | None:
        """Run a health probe now if one is due (the prober thread does this)."""
        return self.remote.probe()

    @property
    def healthy(self) -> bool:
        return self.remote.healthy

    def stats(self) -> dict[str, Any]:
        out = {"name": self.name, "policy": self.policy, **self.remote.stats()}
        with self._lock:
            c = self._counts
            out.update({
                "hits": c["hits"],
                "misses": c["misses"],
                "pending_hits": c["pending_hits"],
                "meta_lookups": c["meta_lookups"],
                "meta_found": c["meta_found"],
                "corrupt": c["corrupt"],
                "stale_children": c["stale_children"],
                "bytes_read": c["bytes_read"],
                "writes": c["writes"],
                "bytes_written": c["bytes_written"],
                "sessions_added": c["sessions_added"],
                "discarded": c["discarded"],
                "deleted_blocks": c["deleted_blocks"],
                "unexpected_errors": c["unexpected_errors"],
                "dropped_writes_by_reason": dict(self._drops),
                "dropped_writes_total": sum(self._drops.values()),
                "queue_depth": self._queue.qsize(),
                "pending_writes": self._queue.unfinished_tasks,
                "ttl_seconds": self._ttl,
            })
        return out

    def close(self) -> None:
        """Send what is queued (unless the circuit is open), then stop the threads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(STOP)
        self._thread.join()
        self.remote.close()

    def __enter__(self) -> RedisTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
