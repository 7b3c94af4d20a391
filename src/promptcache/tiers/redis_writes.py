"""The Redis tier's write side: the writer thread's batches and the deletions.

A batch is written in two pipelined round trips on the write client: (1) the session
fields already on the target blocks (so their session sets' TTLs are refreshed with
the block's, and session deletion can still find the block), (2) every put, new
session and discard of the batch, in queue order. Recording sessions on an existing
block (and only if it exists) is a one-key Lua script, so it is safe on a Cluster.
Both deletions run under the tier's write lock, after the batch in flight.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..codec import checksum
from ..errors import TierError
from ..meta import validate_tenant
from .redis_client import Client, Skipped
from .redis_keys import (
    META_FIELD,
    PAYLOAD_FIELD,
    SESSION_FIELD_PREFIX,
    KeySpace,
    encode_record,
    record_parent,
)

if TYPE_CHECKING:
    from .redis import RedisTier

log = logging.getLogger(__name__)

SCAN_COUNT = 1000
DELETE_BATCH = 500


def _session_fields(fields: list[bytes]) -> list[str]:
    n = len(SESSION_FIELD_PREFIX)
    return [f[n:].decode("utf-8", "replace") for f in fields if f.startswith(SESSION_FIELD_PREFIX)]


def write_batch(tier: RedisTier, batch: list[Any]) -> None:
    from .redis import _ADD_SESSIONS, _Discard, _Put, _Sessions

    keys, ttl, cfg = tier.keys, tier._ttl, tier.config
    work: list[tuple[Any, Any]] = []  # (item, encoded data | None)
    with tier._lock:
        items = [it for it in batch if not (isinstance(it, _Put) and it.cancelled)]
    for it in items:
        if isinstance(it, _Put):
            try:
                data = it.data()
            except Exception as e:  # a payload that cannot be encoded is dropped
                log.warning("cannot encode block %s for redis: %s", it.meta.block_hash.hex()[:16], e)
                tier._drop("encode")
                continue
            if len(data) > cfg.max_value_bytes:
                tier._drop("too_large")
                continue
            work.append((it, data))
        else:
            work.append((it, None))
    if not work:
        return
    puts = [it for it, _ in work if isinstance(it, _Put)]

    def block_key(it: Any) -> str:
        if isinstance(it, _Put):
            return keys.block(it.meta.tenant, it.meta.namespace_key, bytes(it.meta.block_hash))
        return keys.block(it.tenant, it.ns_key, it.block_hash)

    targets = [block_key(it) for it, _ in work if not isinstance(it, _Discard)]

    def existing_sessions(c: Client) -> list[Any]:
        pipe = c.pipeline(transaction=False)
        for k in targets:
            pipe.hkeys(k)
        return list(pipe.execute())

    def write(c: Client, existing: dict[str, list[str]]) -> list[Any]:
        """Puts and discards in one pipeline (queue order), then the session scripts
        (a Cluster pipeline cannot run scripts); returns the scripts' replies."""
        pipe = c.pipeline(transaction=False)
        scripts: list[tuple[str, list[bytes]]] = []
        for it, data in work:
            if isinstance(it, _Put):
                m = it.meta
                h, parent = bytes(m.block_hash), bytes(m.parent_hash)
                record = encode_record(m, len(data), checksum(data))
                bkey = block_key(it)
                with tier._lock:
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
            elif isinstance(it, _Sessions):
                with tier._lock:
                    fields = [SESSION_FIELD_PREFIX + s.encode("utf-8") for s in sorted(it.sessions)]
                scripts.append((block_key(it), fields))
            else:
                pipe.delete(block_key(it))
        if len(pipe):
            pipe.execute()
        return [c.eval(_ADD_SESSIONS, 1, key, ttl, *fields) if fields else None
                for key, fields in scripts]

    try:
        found = tier._call("write", existing_sessions, kind="write") if targets else []
        existing = {k: _session_fields(f or []) for k, f in zip(targets, found, strict=True)}
        replies = tier._call("write", lambda c: write(c, existing), kind="write")
    except Skipped:
        tier._drop("circuit_open", len(puts))
        return
    except TierError as e:
        log.debug("redis write batch failed: %s", e)
        tier._drop("error", len(puts))
        return
    followups: list[tuple[str, str, list[str]]] = []  # (tenant, member, sessions)
    session_items = [it for it, _ in work if isinstance(it, _Sessions)]
    for it, reply in zip(session_items, replies, strict=True):
        parent = record_parent(reply) if reply else None
        if parent is not None:
            followups.append((it.tenant, KeySpace.member(it.ns_key, it.block_hash, parent),
                              sorted(it.sessions)))
    with tier._lock:
        tier._counts["writes"] += len(puts)
        tier._counts["bytes_written"] += sum(len(d) for it, d in work if isinstance(it, _Put))
        tier._counts["discarded"] += sum(1 for it, _ in work if isinstance(it, _Discard))
        tier._counts["sessions_added"] += len(followups)
    if followups:
        def index(c: Client) -> None:
            pipe = c.pipeline(transaction=False)
            for tenant, member, sessions in followups:
                for s in sessions:
                    pipe.sadd(keys.session(tenant, s), member)
                    pipe.expire(keys.session(tenant, s), ttl)
            pipe.execute()

        try:
            tier._call("write", index, kind="write")
        except TierError as e:
            log.debug("redis session index update failed: %s", e)


def _tenant_of_key(keys: KeySpace, key: str) -> str:
    """The tenant segment of one of the tier's keys."""
    return key[len(keys.base) + 1:].split(":", 1)[0]


def delete_session(tier: RedisTier, session_id: str, tenant: str | None) -> int:
    """Remove ``session_id`` from its blocks (of ``tenant``, or of every tenant); a block
    left without sessions is deleted. Returns the number of blocks deleted."""
    from .redis import _DROP_SESSION, _Sessions

    if not isinstance(session_id, str) or not session_id:
        raise ValueError("session_id must be a non-empty string")
    if tenant is not None:
        validate_tenant(tenant)
    keys = tier.keys
    field = SESSION_FIELD_PREFIX + session_id.encode("utf-8")
    with tier._write_lock:
        cancelled = 0
        with tier._lock:
            for p in list(tier._pending.values()):
                if tenant is not None and p.meta.tenant != tenant:
                    continue
                p.sessions.discard(session_id)
                if p.had_session and not p.sessions and not p.cancelled:
                    p.cancelled = True
                    tier._forget(p)
                    cancelled += 1
            for it in list(tier._queue.queue):
                if isinstance(it, _Sessions) and (tenant is None or it.tenant == tenant):
                    it.sessions.discard(session_id)

        def run(c: Client) -> int:
            if tenant is not None:
                set_keys = [keys.session(tenant, session_id)]
            else:
                set_keys = [k.decode() if isinstance(k, bytes) else k
                            for k in c.scan_iter(match=keys.session_pattern(session_id),
                                                 count=SCAN_COUNT)]
            deleted = 0
            for skey in set_keys:
                t = _tenant_of_key(keys, skey)
                for member in c.smembers(skey):
                    ns_key, h, parent = KeySpace.parse_member(member)
                    if c.eval(_DROP_SESSION, 1, keys.block(t, ns_key, h), field) == 2:
                        deleted += 1
                        c.hdel(keys.kids(t, ns_key, parent), h.hex())
                c.delete(skey)
            return deleted

        deleted = int(tier._call("delete_session", run, kind="write"))
        with tier._lock:
            tier._counts["deleted_blocks"] += deleted
        return deleted + cancelled


def delete_tenant(tier: RedisTier, tenant: str | None) -> int:
    """Delete every key of ``tenant`` (None: every key of the tier). Returns the number
    of blocks deleted (queued ones included)."""
    if tenant is not None:
        validate_tenant(tenant)
    keys = tier.keys
    with tier._write_lock:
        with tier._lock:
            cancelled = 0
            for p in list(tier._pending.values()):
                if not p.cancelled and (tenant is None or p.meta.tenant == tenant):
                    p.cancelled = True
                    tier._forget(p)
                    cancelled += 1

        def run(c: Client) -> int:
            blocks = 0
            batch: list[str] = []

            def drop() -> None:
                pipe = c.pipeline(transaction=False)
                for k in batch:
                    pipe.unlink(k)
                pipe.execute()
                batch.clear()

            for raw in c.scan_iter(match=keys.tenant_pattern(tenant), count=SCAN_COUNT):
                k = raw.decode() if isinstance(raw, bytes) else raw
                parts = k.split(":")
                if len(parts) == 6 and parts[4] == "b":
                    blocks += 1
                batch.append(k)
                if len(batch) >= DELETE_BATCH:
                    drop()
            if batch:
                drop()
            return blocks

        deleted = int(tier._call("delete_tenant", run, kind="write"))
        with tier._lock:
            tier._counts["deleted_blocks"] += deleted
        return deleted + cancelled
