"""The Redis tier's read path: one pipelined round trip per read, answered first from pending puts.
A damaged block is deleted, counted ``corrupt`` and read as a miss.
"""

from __future__ import annotations

import logging
from typing import Any

from ..codec import checksum_matches
from ..errors import CorruptBlockError, TierError
from ..meta import BlockMeta, Namespace
from .redis_client import Client, Remote, Skipped, Tally
from .redis_keys import (
    META_FIELD,
    PAYLOAD_FIELD,
    SESSION_FIELD_PREFIX,
    KeySpace,
    Record,
    decode_record,
    record_parent,
)
from .redis_queue import WriteQueue

log = logging.getLogger(__name__)

Fetched = tuple[bytes, list[str]] | None | CorruptBlockError


def _sessions(fields: Any) -> list[str]:
    n = len(SESSION_FIELD_PREFIX)
    return sorted(
        f[n:].decode("utf-8", "replace") for f in fields if f.startswith(SESSION_FIELD_PREFIX)
    )


class Reads:
    """The read path over ``remote``, answering first from ``writes``' pending puts."""

    def __init__(self, remote: Remote, keys: KeySpace, writes: WriteQueue, tally: Tally) -> None:
        self.remote = remote
        self.keys = keys
        self.writes = writes
        self.tally = tally

    def corrupt(self, ns: Namespace, h: bytes, parent: bytes | None, why: str) -> None:
        """Delete a damaged block (best effort) and count it."""
        log.warning("redis block %s is damaged (%s): deleted", h.hex()[:16], why)
        self.tally.add("corrupt")
        key = self.keys.block(ns.tenant, ns.key, h)

        def drop(c: Client) -> None:
            pipe = c.pipeline(transaction=False)
            pipe.delete(key)
            if parent is not None:
                pipe.hdel(self.keys.kids(ns.tenant, ns.key, parent), h.hex())
            pipe.execute()

        try:
            self.remote.call("delete damaged block", drop)
        except TierError:
            pass

    def get_metas(self, hs: list[bytes], ns: Namespace | None) -> list[BlockMeta | None]:
        """Metadata of many blocks in one round trip (None where absent or damaged)."""
        out: list[BlockMeta | None] = [None] * len(hs)
        if ns is None or not hs:
            return out
        ask: list[int] = []
        with self.writes.lock:
            for i, h in enumerate(hs):
                p = self.writes.pending_for(h, ns)
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
            raw = self.remote.call("lookup", fetch)
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
                self.corrupt(ns, hs[i], None, str(e))
        self.tally.add("meta_lookups", len(ask))
        self.tally.add("meta_found", found)
        return out

    def children(self, parent: bytes, ns: Namespace | None) -> list[BlockMeta]:
        """The children of ``parent`` by hash; stale or damaged index entries are removed."""
        if ns is None:
            return []
        kids_key = self.keys.kids(ns.tenant, ns.key, parent)
        out: dict[bytes, BlockMeta] = {}
        with self.writes.lock:
            for h, p in self.writes.pending.items():
                if bytes(p.meta.parent_hash) == parent and self.writes.pending_for(h, ns) is not None:
                    out[h] = p.meta
        try:
            raw: dict[bytes, bytes] = self.remote.call("children", lambda c: c.hgetall(kids_key))
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
                self.tally.add("corrupt")
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
                alive = self.remote.call("children", exists)
            except Skipped:
                alive = [0] * len(order)
            stale = [h.hex().encode() for h, a in zip(order, alive, strict=True) if not a]
            if stale:
                self.tally.add("stale_children", len(stale))
                self._try_hdel(kids_key, stale)
            for h, a in zip(order, alive, strict=True):
                if a:
                    out[h] = found[h]
        return [out[h] for h in sorted(out)]

    def _try_hdel(self, key: str, fields: list[bytes]) -> None:
        try:
            self.remote.call("clean index", lambda c: c.hdel(key, *fields))
        except TierError:
            pass

    def sessions_of(self, h: bytes, ns: Namespace | None) -> list[str]:
        if ns is None:
            return []
        with self.writes.lock:
            p = self.writes.pending_for(h, ns)
            if p is not None:
                return sorted(p.sessions)
        key = self.keys.block(ns.tenant, ns.key, h)
        try:
            fields = self.remote.call("sessions", lambda c: c.hkeys(key))
        except Skipped:
            return []
        return _sessions(fields)

    def fetch(self, hs: list[bytes], ns: Namespace | None) -> list[Fetched]:
        """``(payload, sessions)`` per block; None if absent, ``CorruptBlockError`` if damaged."""
        out: list[Fetched] = [None] * len(hs)
        if ns is None or not hs:
            return out
        ask: list[int] = []
        for i, h in enumerate(hs):
            with self.writes.lock:
                p = self.writes.pending_for(h, ns)
                sessions = sorted(p.sessions) if p is not None else []
            if p is not None:
                try:
                    out[i] = (p.data(), sessions)
                    self.tally.add("pending_hits")
                    continue
                except Exception:  # an unencodable pending block: ask Redis
                    pass
            ask.append(i)
        if not ask:
            return out
        keys = [self.keys.block(ns.tenant, ns.key, hs[i]) for i in ask]

        def run(c: Client) -> list[Any]:
            pipe = c.pipeline(transaction=False)
            for k in keys:
                pipe.hgetall(k)  # record, payload and session fields: one command
            return list(pipe.execute())

        try:
            raw = self.remote.call("get", run)
        except Skipped:
            return out
        hits = misses = nbytes = 0
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
                if not checksum_matches(payload, rec.payload_checksum):
                    raise CorruptBlockError("payload checksum mismatch")
            except CorruptBlockError as e:
                self.corrupt(ns, h, record_parent(data), str(e))
                out[i] = CorruptBlockError(f"redis block {h.hex()[:16]}: {e}; deleted")
                continue
            out[i] = (bytes(payload), _sessions(fields))
            hits += 1
            nbytes += len(payload)
        with self.tally.lock:
            self.tally.counts["hits"] += hits
            self.tally.counts["misses"] += misses
            self.tally.counts["bytes_read"] += nbytes
        return out
