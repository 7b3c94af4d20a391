"""The Redis tier's writer thread: each batch in two pipelined round trips under the write lock
(existing blocks' sessions, then puts, sessions and discards in order)."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from ..codec import checksum
from ..errors import TierError
from .redis_client import Client, Remote, Skipped, Tally
from .redis_keys import (
    META_FIELD,
    PAYLOAD_FIELD,
    SESSION_FIELD_PREFIX,
    KeySpace,
    encode_record,
    record_parent,
)
from .redis_queue import STOP, Discard, Put, Sessions, WriteQueue

log = logging.getLogger(__name__)

MAX_BATCH_ITEMS = 256

# KEYS[1] = block; ARGV = ttl, session fields...: record sessions on an existing block
_ADD_SESSIONS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
for i = 2, #ARGV do redis.call('HSET', KEYS[1], ARGV[i], '1') end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return redis.call('HGET', KEYS[1], 'm')
"""


def _session_fields(fields: list[bytes]) -> list[str]:
    n = len(SESSION_FIELD_PREFIX)
    return [f[n:].decode("utf-8", "replace") for f in fields if f.startswith(SESSION_FIELD_PREFIX)]


def _estimate(payload: Any) -> int:
    if isinstance(payload, bytes | bytearray | memoryview):
        return len(payload)
    n = getattr(payload, "nbytes", 0)  # a PayloadSource's size estimate
    return int(n) if isinstance(n, int) else 0


class Writer:
    """The writer thread's work: batches off ``writes`` sent over ``remote`` under ``lock``."""

    def __init__(self, remote: Remote, keys: KeySpace, writes: WriteQueue, tally: Tally,
                 ttl: int) -> None:
        self.remote = remote
        self.keys = keys
        self.writes = writes
        self.tally = tally
        self.ttl = ttl
        self.lock = threading.RLock()  # the writer's batches vs admin deletions

    def run(self) -> None:
        """The writer thread: take, write and forget batches until ``STOP``."""
        q = self.writes.queue
        while True:
            item = q.get()
            if item is STOP:
                q.task_done()
                return
            batch = [item]
            size = _estimate(getattr(item, "payload", b""))
            stop = False
            while len(batch) < MAX_BATCH_ITEMS and size < self.writes.config.batch_bytes:
                try:
                    nxt = q.get_nowait()
                except queue.Empty:
                    break
                if nxt is STOP:
                    stop = True
                    break
                batch.append(nxt)
                size += _estimate(getattr(nxt, "payload", b""))
            try:
                with self.lock:
                    self.write_batch(batch)
            except Exception:  # the writer must survive anything
                log.exception("redis writer: unexpected error")
            finally:
                with self.writes.lock:
                    for it in batch:
                        if isinstance(it, Put):
                            self.writes.forget(it)
                for _ in batch:
                    q.task_done()
            if stop:
                q.task_done()
                return

    def write_batch(self, batch: list[Any]) -> None:
        keys, ttl, cfg = self.keys, self.ttl, self.writes.config
        work: list[tuple[Any, Any]] = []  # (item, encoded data | None)
        with self.writes.lock:
            items = [it for it in batch if not (isinstance(it, Put) and it.cancelled)]
        for it in items:
            if isinstance(it, Put):
                try:
                    data = it.data()
                except Exception as e:  # a payload that cannot be encoded is dropped
                    log.warning("cannot encode block %s for redis: %s", it.meta.block_hash.hex()[:16], e)
                    self.writes.drop("encode")
                    continue
                if len(data) > cfg.max_value_bytes:
                    self.writes.drop("too_large")
                    continue
                work.append((it, data))
            else:
                work.append((it, None))
        if not work:
            return
        puts = [it for it, _ in work if isinstance(it, Put)]

        def block_key(it: Any) -> str:
            if isinstance(it, Put):
                return keys.block(it.meta.tenant, it.meta.namespace_key, bytes(it.meta.block_hash))
            return keys.block(it.tenant, it.ns_key, it.block_hash)

        targets = [block_key(it) for it, _ in work if not isinstance(it, Discard)]

        def existing_sessions(c: Client) -> list[Any]:
            pipe = c.pipeline(transaction=False)
            for k in targets:
                pipe.hkeys(k)
            return list(pipe.execute())

        def write(c: Client, existing: dict[str, list[str]]) -> list[Any]:
            """Puts and discards in one pipeline, then the session scripts (not in Cluster ones)."""
            pipe = c.pipeline(transaction=False)
            scripts: list[tuple[str, list[bytes]]] = []
            for it, data in work:
                if isinstance(it, Put):
                    m = it.meta
                    h, parent = bytes(m.block_hash), bytes(m.parent_hash)
                    record = encode_record(m, len(data), checksum(data))
                    bkey = block_key(it)
                    with self.writes.lock:
                        sessions = set(it.sessions)
                    mapping: dict[bytes, bytes] = {META_FIELD: record, PAYLOAD_FIELD: data}
                    for s in sessions:
                        mapping[SESSION_FIELD_PREFIX + s.encode("utf-8")] = b"1"
                    pipe.hset(bkey, mapping=mapping)
                    pipe.expire(bkey, ttl)
                    kkey = keys.kids(m.tenant, m.namespace_key, parent)
                    pipe.hset(kkey, h.hex(), record)
                    pipe.expire(kkey, ttl)
                    member = keys.member(m.namespace_key, h, parent)
                    for s in sessions:
                        pipe.sadd(keys.session(m.tenant, s), member)
                    for s in sessions | set(existing.get(bkey, ())):
                        pipe.expire(keys.session(m.tenant, s), ttl)
                elif isinstance(it, Sessions):
                    with self.writes.lock:
                        fields = [SESSION_FIELD_PREFIX + s.encode("utf-8") for s in sorted(it.sessions)]
                    scripts.append((block_key(it), fields))
                else:
                    pipe.delete(block_key(it))
            if len(pipe):
                pipe.execute()
            return [c.eval(_ADD_SESSIONS, 1, key, ttl, *fields) if fields else None
                    for key, fields in scripts]

        try:
            found = self.remote.call("write", existing_sessions, kind="write") if targets else []
            existing = {k: _session_fields(f or []) for k, f in zip(targets, found, strict=True)}
            replies = self.remote.call("write", lambda c: write(c, existing), kind="write")
        except Skipped:
            self.writes.drop("circuit_open", len(puts))
            return
        except TierError as e:
            log.debug("redis write batch failed: %s", e)
            self.writes.drop("error", len(puts))
            return
        followups: list[tuple[str, str, list[str]]] = []  # (tenant, member, sessions)
        session_items = [it for it, _ in work if isinstance(it, Sessions)]
        for it, reply in zip(session_items, replies, strict=True):
            parent = record_parent(reply) if reply else None
            if parent is not None:
                followups.append((it.tenant, KeySpace.member(it.ns_key, it.block_hash, parent),
                                  sorted(it.sessions)))
        with self.tally.lock:
            self.tally.counts["writes"] += len(puts)
            self.tally.counts["bytes_written"] += sum(len(d) for it, d in work if isinstance(it, Put))
            self.tally.counts["discarded"] += sum(1 for it, _ in work if isinstance(it, Discard))
            self.tally.counts["sessions_added"] += len(followups)
        if followups:
            def index(c: Client) -> None:
                pipe = c.pipeline(transaction=False)
                for tenant, member, sessions in followups:
                    for s in sessions:
                        pipe.sadd(keys.session(tenant, s), member)
                        pipe.expire(keys.session(tenant, s), ttl)
                pipe.execute()

            try:
                self.remote.call("write", index, kind="write")
            except TierError as e:
                log.debug("redis session index update failed: %s", e)
