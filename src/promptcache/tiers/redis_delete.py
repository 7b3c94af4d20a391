"""The Redis tier's deletions by session and by tenant (admin, synchronous, under the write lock
between batches; matching pending puts cancelled first)."""

from __future__ import annotations

import threading

from ..meta import validate_tenant
from .redis_client import Client, Remote, Tally
from .redis_keys import SESSION_FIELD_PREFIX, KeySpace
from .redis_queue import Sessions, WriteQueue

SCAN_COUNT = 1000
DELETE_BATCH = 500

# KEYS[1] = block; ARGV[1] = session field: 0 not there, 1 removed, 2 block deleted
_DROP_SESSION = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
for _, f in ipairs(redis.call('HKEYS', KEYS[1])) do
  if string.sub(f, 1, 2) == 's:' then return 1 end
end
redis.call('DEL', KEYS[1])
return 2
"""


def _tenant_of_key(keys: KeySpace, key: str) -> str:
    """The tenant segment of one of the tier's keys."""
    return key[len(keys.base) + 1:].split(":", 1)[0]


class Deleter:
    """Deletions by session and tenant over ``remote``, under the writer's ``write_lock``."""

    def __init__(self, remote: Remote, keys: KeySpace, writes: WriteQueue, tally: Tally,
                 write_lock: threading.RLock) -> None:
        self.remote = remote
        self.keys = keys
        self.writes = writes
        self.tally = tally
        self.write_lock = write_lock

    def delete_session(self, session_id: str, tenant: str | None) -> set[bytes]:
        """Remove ``session_id`` from its blocks, deleting those left without; their hashes."""
        if not isinstance(session_id, str) or not session_id:
            raise ValueError("session_id must be a non-empty string")
        if tenant is not None:
            validate_tenant(tenant)
        keys = self.keys
        field = SESSION_FIELD_PREFIX + session_id.encode("utf-8")
        with self.write_lock:
            cancelled: set[bytes] = set()
            with self.writes.lock:
                for p in list(self.writes.pending.values()):
                    if tenant is not None and p.meta.tenant != tenant:
                        continue
                    p.sessions.discard(session_id)
                    if p.had_session and not p.sessions and not p.cancelled:
                        p.cancelled = True
                        self.writes.forget(p)
                        cancelled.add(bytes(p.meta.block_hash))
                for it in list(self.writes.queue.queue):
                    if isinstance(it, Sessions) and (tenant is None or it.tenant == tenant):
                        it.sessions.discard(session_id)

            def run(c: Client) -> set[bytes]:
                if tenant is not None:
                    set_keys = [keys.session(tenant, session_id)]
                else:
                    set_keys = [k.decode() if isinstance(k, bytes) else k
                                for k in c.scan_iter(match=keys.session_pattern(session_id),
                                                     count=SCAN_COUNT)]
                deleted: set[bytes] = set()
                for skey in set_keys:
                    t = _tenant_of_key(keys, skey)
                    for member in c.smembers(skey):
                        ns_key, h, parent = KeySpace.parse_member(member)
                        if c.eval(_DROP_SESSION, 1, keys.block(t, ns_key, h), field) == 2:
                            deleted.add(h)
                            c.hdel(keys.kids(t, ns_key, parent), h.hex())
                    c.delete(skey)
                return deleted

            deleted: set[bytes] = set(self.remote.call("delete_session", run, kind="write"))
            self.tally.add("deleted_blocks", len(deleted))
            return deleted | cancelled

    def delete_tenant(self, tenant: str | None) -> int:
        """Delete every key of ``tenant`` (None: of the tier); returns the blocks deleted."""
        if tenant is not None:
            validate_tenant(tenant)
        keys = self.keys
        with self.write_lock:
            with self.writes.lock:
                cancelled = 0
                for p in list(self.writes.pending.values()):
                    if not p.cancelled and (tenant is None or p.meta.tenant == tenant):
                        p.cancelled = True
                        self.writes.forget(p)
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

            deleted = int(self.remote.call("delete_tenant", run, kind="write"))
            self.tally.add("deleted_blocks", deleted)
            return deleted + cancelled
