"""The shared Redis / Valkey tier (standalone or Cluster): several servers reuse
each other's blocks. Key layout and records: ``redis_keys``; connections, timeouts,
the circuit breaker and the prober: ``redis_client``.

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
keys), the payload must have the recorded size and sha256; a damaged block is
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
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..codec import checksum
from ..config import RedisConfig
from ..errors import CorruptBlockError, TierError
from ..hashing import BlockHash
from ..meta import BlockMeta, Namespace
from .base import PayloadSource, as_source
from .redis_client import Client, Remote, Skipped
from .redis_keys import (
    META_FIELD,
    PAYLOAD_FIELD,
    SESSION_FIELD_PREFIX,
    KeySpace,
    Record,
    decode_record,
    record_parent,
)

log = logging.getLogger(__name__)

_STOP = object()
DROP_REASONS = ("queue_full", "circuit_open", "too_large", "closed", "error", "encode")
MAX_BATCH_ITEMS = 256

# KEYS[1] = block; ARGV = ttl, session fields...: record sessions on an existing block
_ADD_SESSIONS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
for i = 2, #ARGV do redis.call('HSET', KEYS[1], ARGV[i], '1') end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return redis.call('HGET', KEYS[1], 'm')
"""
# KEYS[1] = block; ARGV[1] = session field: 0 not there, 1 removed, 2 block deleted
_DROP_SESSION = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
for _, f in ipairs(redis.call('HKEYS', KEYS[1])) do
  if string.sub(f, 1, 2) == 's:' then return 1 end
end
redis.call('DEL', KEYS[1])
return 2
"""


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


@dataclass(eq=False)
class _Put:
    meta: BlockMeta
    payload: PayloadSource  # encoded (memoised) on the writer thread
    sessions: set[str] = field(default_factory=set)
    had_session: bool = False
    cancelled: bool = False

    def data(self) -> bytes:
        return bytes(self.payload.encode())


@dataclass(eq=False)
class _Sessions:
    block_hash: bytes
    tenant: str
    ns_key: str
    sessions: set[str]


@dataclass(eq=False)
class _Discard:
    block_hash: bytes
    tenant: str
    ns_key: str


def _estimate(payload: Any) -> int:
    if isinstance(payload, bytes | bytearray | memoryview):
        return len(payload)
    n = getattr(payload, "nbytes", 0)  # a PayloadSource's size estimate
    return int(n) if isinstance(n, int) else 0


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
        self._pending: dict[bytes, _Put] = {}
        self._counts: Counter[str] = Counter()
        self._drops: Counter[str] = Counter({r: 0 for r in DROP_REASONS})
        self._closed = False
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=config.queue_size)
        self._thread = threading.Thread(target=self._run, name="promptcache-redis-writer",
                                        daemon=True)
        self._thread.start()

    # -- helpers ----------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[Client], Any], kind: str = "read") -> Any:
        return self.remote.call(what, fn, kind=kind)

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def _drop(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self._drops[reason] += n

    def _pending_for(self, h: bytes, ns: Namespace) -> _Put | None:
        p = self._pending.get(h)
        if p is None or p.cancelled or p.meta.namespace_key != ns.key or p.meta.tenant != ns.tenant:
            return None
        return p

    def _corrupt(self, ns: Namespace, h: bytes, parent: bytes | None, why: str) -> None:
        """Delete a damaged block (best effort) and count it."""
        log.warning("redis block %s is damaged (%s): deleted", h.hex()[:16], why)
        self._count("corrupt")
        key = self.keys.block(ns.tenant, ns.key, h)

        def drop(c: Client) -> None:
            pipe = c.pipeline(transaction=False)
            pipe.delete(key)
            if parent is not None:
                pipe.hdel(self.keys.kids(ns.tenant, ns.key, parent), h.hex())
            pipe.execute()

        try:
            self._call("delete damaged block", drop)
        except TierError:
            pass

    # -- metadata queries ---------------------------------------------------------------
    @_boundary
    def get_meta(self, block_hash: BlockHash, *, ns: Namespace | None = None) -> BlockMeta | None:
        return self.get_metas([block_hash], ns=ns)[0]

    @_boundary
    def get_metas(self, block_hashes: Sequence[BlockHash], *, ns: Namespace | None = None
                  ) -> list[BlockMeta | None]:
        """Metadata of many blocks in one round trip (None where absent or damaged)."""
        hs = [bytes(h) for h in block_hashes]
        out: list[BlockMeta | None] = [None] * len(hs)
        if ns is None or not hs:
            return out
        ask: list[int] = []
        with self._lock:
            for i, h in enumerate(hs):
                p = self._pending_for(h, ns)
                if p is not None:
                    out[i] = p.meta
                else:
                    ask.append(i)
        if not ask:
            return out
        keys = [self.keys.block(ns.tenant, ns.key, hs[i]) for i in ask]

        def fetch(c: Client) -> list[Any]:
            pipe = c.pipeline(transaction=False)
            for k in keys:
                pipe.hget(k, META_FIELD)
            return list(pipe.execute())

        try:
            raw = self._call("lookup", fetch)
        except Skipped:
            return out
        found = 0
        for i, data in zip(ask, raw, strict=True):
            if data is None:
                continue
            try:
                out[i] = decode_record(data, block_hash=hs[i], ns_key=ns.key, tenant=ns.tenant).meta
                found += 1
            except CorruptBlockError as e:
                self._corrupt(ns, hs[i], None, str(e))
        self._count("meta_lookups", len(ask))
        self._count("meta_found", found)
        return out

    @_boundary
    def children(self, parent_hash: BlockHash, *, ns: Namespace | None = None) -> list[BlockMeta]:
        if ns is None:
            return []
        parent = bytes(parent_hash)
        kids_key = self.keys.kids(ns.tenant, ns.key, parent)
        out: dict[bytes, BlockMeta] = {}
        with self._lock:
            for h, p in self._pending.items():
                if bytes(p.meta.parent_hash) == parent and self._pending_for(h, ns) is not None:
                    out[h] = p.meta
        try:
            raw: dict[bytes, bytes] = self._call("children", lambda c: c.hgetall(kids_key))
        except Skipped:
            raw = {}
        found: dict[bytes, BlockMeta] = {}
        for child_hex, data in raw.items():
            try:
                h = bytes.fromhex(child_hex.decode("ascii"))
                meta = decode_record(data, block_hash=h, ns_key=ns.key, tenant=ns.tenant).meta
                if bytes(meta.parent_hash) != parent:
                    raise CorruptBlockError("child record names another parent")
            except (CorruptBlockError, ValueError, UnicodeDecodeError) as e:
                self._count("corrupt")
                log.warning("redis children index entry damaged (%s): removed", e)
                self._try_hdel(kids_key, [child_hex])
                continue
            if h not in out:
                found[h] = meta
        if found:  # the index may outlive a child (TTL, maxmemory eviction): check
            order = list(found)
            block_keys = [self.keys.block(ns.tenant, ns.key, h) for h in order]

            def exists(c: Client) -> list[Any]:
                pipe = c.pipeline(transaction=False)
                for k in block_keys:
                    pipe.exists(k)
                return list(pipe.execute())

            try:
                alive = self._call("children", exists)
            except Skipped:
                alive = [0] * len(order)
            stale = [h.hex().encode() for h, a in zip(order, alive, strict=True) if not a]
            if stale:
                self._count("stale_children", len(stale))
                self._try_hdel(kids_key, stale)
            for h, a in zip(order, alive, strict=True):
                if a:
                    out[h] = found[h]
        return [out[h] for h in sorted(out)]

    def _try_hdel(self, key: str, fields: list[bytes]) -> None:
        try:
            self._call("clean index", lambda c: c.hdel(key, *fields))
        except TierError:
            pass

    @_boundary
    def sessions_of(self, block_hash: BlockHash, *, ns: Namespace | None = None) -> list[str]:
        if ns is None:
            return []
        h = bytes(block_hash)
        with self._lock:
            p = self._pending_for(h, ns)
            if p is not None:
                return sorted(p.sessions)
        key = self.keys.block(ns.tenant, ns.key, h)
        try:
            fields = self._call("sessions", lambda c: c.hkeys(key))
        except Skipped:
            return []
        n = len(SESSION_FIELD_PREFIX)
        return sorted(
            f[n:].decode("utf-8", "replace") for f in fields if f.startswith(SESSION_FIELD_PREFIX)
        )

    # -- payload reads --------------------------------------------------------------------
    @_boundary
    def get(self, block_hash: BlockHash, *, ns: Namespace | None = None) -> bytes | None:
        got = self._fetch([bytes(block_hash)], ns)[0]
        if isinstance(got, CorruptBlockError):
            raise got
        return None if got is None else got[0]

    @_boundary
    def get_many(self, block_hashes: Sequence[BlockHash], *, ns: Namespace | None = None
                 ) -> list[tuple[bytes, list[str]] | None]:
        """``(payload, sessions)`` of many blocks in one round trip (None where absent
        or damaged: a damaged block is deleted and counted)."""
        return [g if isinstance(g, tuple) else None
                for g in self._fetch([bytes(h) for h in block_hashes], ns)]

    def _fetch(self, hs: list[bytes], ns: Namespace | None
               ) -> list[tuple[bytes, list[str]] | None | CorruptBlockError]:
        out: list[tuple[bytes, list[str]] | None | CorruptBlockError] = [None] * len(hs)
        if ns is None or not hs:
            return out
        ask: list[int] = []
        for i, h in enumerate(hs):
            with self._lock:
                p = self._pending_for(h, ns)
                sessions = sorted(p.sessions) if p is not None else []
            if p is not None:
                try:
                    out[i] = (p.data(), sessions)
                    self._count("pending_hits")
                    continue
                except Exception:  # an unencodable pending block: ask Redis
                    pass
            ask.append(i)
        if not ask:
            return out
        keys = [self.keys.block(ns.tenant, ns.key, hs[i]) for i in ask]

        def fetch(c: Client) -> list[Any]:
            pipe = c.pipeline(transaction=False)
            for k in keys:
                pipe.hgetall(k)  # record, payload and session fields: one command
            return list(pipe.execute())

        try:
            raw = self._call("get", fetch)
        except Skipped:
            return out
        hits = misses = nbytes = 0
        n = len(SESSION_FIELD_PREFIX)
        for i, fields in zip(ask, raw, strict=True):
            h = hs[i]
            data, payload = fields.get(META_FIELD), fields.get(PAYLOAD_FIELD)
            if data is None or payload is None:
                misses += 1
                continue
            try:
                rec: Record = decode_record(data, block_hash=h, ns_key=ns.key, tenant=ns.tenant)
                if len(payload) != rec.payload_len:
                    raise CorruptBlockError(
                        f"payload is {len(payload)} bytes, the record says {rec.payload_len}")
                if checksum(payload) != rec.payload_sha256:
                    raise CorruptBlockError("payload checksum mismatch")
            except CorruptBlockError as e:
                self._corrupt(ns, h, record_parent(data), str(e))
                out[i] = CorruptBlockError(f"redis block {h.hex()[:16]}: {e}; deleted")
                continue
            sessions = sorted(f[n:].decode("utf-8", "replace") for f in fields
                              if f.startswith(SESSION_FIELD_PREFIX))
            out[i] = (bytes(payload), sessions)
            hits += 1
            nbytes += len(payload)
        with self._lock:
            self._counts["hits"] += hits
            self._counts["misses"] += misses
            self._counts["bytes_read"] += nbytes
        return out

    # -- writes (queued) ------------------------------------------------------------------
    @_boundary
    def put(self, meta: BlockMeta, payload: bytes | PayloadSource, sessions: Iterable[str] = (),
            hits: int | None = None, *, timeout: float | None = 0.0) -> bool:
        """Queue a block for writing; False if refused (counted by reason).
        ``timeout``: how long to wait for room in a full queue (0: never wait, the
        request path; None: as long as it takes)."""
        if not isinstance(meta, BlockMeta):
            raise ValueError(f"meta must be a BlockMeta, got {type(meta).__name__}")
        if len(meta.block_hash) != 32 or len(meta.parent_hash) != 32:
            raise ValueError("block and parent hashes must be 32 bytes")
        if isinstance(payload, str):
            raise ValueError("payload must be bytes or a PayloadSource, got str")
        source = as_source(payload)  # ValueError for anything else
        if isinstance(sessions, str):
            raise ValueError("sessions must be an iterable of session ids, not a string")
        h = bytes(meta.block_hash)
        item = _Put(meta, source, {str(s) for s in sessions})
        item.had_session = bool(item.sessions)
        with self._lock:
            reason = None
            if self._closed:
                reason = "closed"
            elif source.nbytes > self.config.max_value_bytes:
                reason = "too_large"
            elif not self.remote.healthy:
                reason = "circuit_open"
            if reason is not None:
                self._drops[reason] += 1
                return False
            old = self._pending.get(h)
            self._pending[h] = item  # before it is queued: the writer forgets it
            try:
                self._queue.put_nowait(item)
                queued = True
            except queue.Full:
                queued = False
        if not queued and timeout != 0:
            try:
                self._queue.put(item, timeout=timeout)
                queued = True
            except queue.Full:
                pass
        with self._lock:
            if not queued and item.cancelled:  # deleted while waiting: nothing to write
                return True
            if not queued:
                self._forget(item)
                if old is not None and self._pending.get(h) is None and not old.cancelled:
                    self._pending[h] = old
                self._drops["queue_full"] += 1
                return False
            if old is not None and old is not item:  # superseded: keep its sessions
                old.cancelled = True
                item.sessions |= old.sessions
                item.had_session = item.had_session or old.had_session
            return True

    @_boundary
    def has_room(self, timeout: float | None = 0.0) -> bool:
        """Whether a put that does not wait would find room in the queue now (waiting
        up to ``timeout`` seconds for it; None: as long as it takes)."""
        q = self._queue
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        with q.not_full:
            while q.maxsize > 0 and q._qsize() >= q.maxsize:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                q.not_full.wait(remaining)
            return True

    @_boundary
    def add_sessions(self, block_hash: BlockHash, sessions: Iterable[str], *,
                     ns: Namespace | None = None) -> None:
        if isinstance(sessions, str):
            raise ValueError("sessions must be an iterable of session ids, not a string")
        sess = {str(s) for s in sessions}
        if not sess or ns is None:
            return
        h = bytes(block_hash)
        with self._lock:
            p = self._pending_for(h, ns)
            if p is not None:
                p.sessions |= sess
                p.had_session = True
                return
            if self._closed:
                return
            try:
                self._queue.put_nowait(_Sessions(h, ns.tenant, ns.key, sess))
            except queue.Full:
                self._drops["queue_full"] += 1

    @_boundary
    def discard(self, block_hashes: Iterable[BlockHash], *, ns: Namespace | None = None) -> int:
        """Delete these blocks (asynchronously, in queue order). Returns how many were
        queued or cancelled."""
        if ns is None:
            return 0
        n = 0
        with self._lock:
            for bh in block_hashes:
                h = bytes(bh)
                p = self._pending_for(h, ns)
                if p is not None:
                    p.cancelled = True
                    del self._pending[h]
                if self._closed:
                    continue
                try:
                    self._queue.put_nowait(_Discard(h, ns.tenant, ns.key))
                    n += 1
                except queue.Full:
                    self._drops["queue_full"] += 1
        return n

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._queue.task_done()
                return
            batch = [item]
            size = _estimate(getattr(item, "payload", b""))
            stop = False
            while len(batch) < MAX_BATCH_ITEMS and size < self.config.batch_bytes:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    stop = True
                    break
                batch.append(nxt)
                size += _estimate(getattr(nxt, "payload", b""))
            try:
                with self._write_lock:
                    self._write_batch(batch)
            except Exception:  # the writer must survive anything
                log.exception("redis writer: unexpected error")
            finally:
                with self._lock:
                    for it in batch:
                        if isinstance(it, _Put):
                            self._forget(it)
                for _ in batch:
                    self._queue.task_done()
            if stop:
                self._queue.task_done()
                return

    def _forget(self, item: _Put) -> None:
        h = bytes(item.meta.block_hash)
        if self._pending.get(h) is item:
            del self._pending[h]

    def _write_batch(self, batch: list[Any]) -> None:
        from .redis_writes import write_batch

        write_batch(self, batch)

    @_boundary
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write was sent (or dropped). True if done within
        ``timeout`` seconds (None: no limit)."""
        q = self._queue
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        with q.all_tasks_done:
            while q.unfinished_tasks:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                q.all_tasks_done.wait(remaining)
        return True

    # -- deletion -------------------------------------------------------------------------
    @_boundary
    def delete_session(self, session_id: str, tenant: str | None = None) -> int:
        from .redis_writes import delete_session

        return delete_session(self, session_id, tenant)

    @_boundary
    def delete_tenant(self, tenant: str | None) -> int:
        from .redis_writes import delete_tenant

        return delete_tenant(self, tenant)

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
        self._queue.put(_STOP)
        self._thread.join()
        self.remote.close()

    def __enter__(self) -> RedisTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
