"""The SSD tier's row commit: the index rows of blocks whose bytes are durably in
place (a published block file, or records of a segment), in one transaction that
re-reads each row (another process may have written the same block meanwhile),
applies early pins and sessions and, for a batch, evicts past the byte budget."""

from __future__ import annotations

import sqlite3

from .ssd_queue import Pending, Queued
from .ssd_schema import IndexRow
from .ssd_store import Catalog, Status


class Committer:
    """Commits rows for the writer (see the module docstring)."""

    def __init__(self, status: Status, cat: Catalog, queued: Queued) -> None:
        self.status, self.cat, self.queued = status, cat, queued

    def commit(self, p: Pending, size: int, rel: str, digest: str, *, dedup: bool) -> bool:
        """Commit the row of a published file ``rel`` (``dedup``: of the file the row
        names; False if that row changed meanwhile). Caller holds the shared ``DirLock``."""
        return self.commit_many([(p, size, rel, digest)], dedup=dedup)

    def commit_many(self, entries: list[tuple[Pending, int, str, str]], *,
                     dedup: bool, evict: bool = False) -> bool:
        """``commit`` of several published files in one transaction (all rows or
        none); ``dedup`` with one entry only. ``evict``: the same transaction deletes
        the least recently used other blocks past the byte budget (their files are
        unlinked after it), so a crash right after a batch leaves the folder over its
        budget by no more than one block, as after a single write."""
        now = self.status.clock()
        ttl = self.cat.config.ttl_seconds
        replaced: list[str] = []
        victims: list[tuple[bytes, str, int]] = []
        pinned = 0
        with self.status.lock:
            live = []
            for p, size, rel, digest in entries:
                if p.cancelled:
                    self.queued.forget(p)
                    if not dedup:
                        self.cat.remove_files([rel])
                else:
                    live.append((p, size, rel, digest))
            if not live:
                return True
            done: list[tuple[Pending, IndexRow | None, str]] = []
            try:
                self.cat.index.begin()
                for p, size, rel, digest in live:
                    h = bytes(p.meta.block_hash)
                    cur = self.cat.index.get(h)
                    if dedup and (cur is None or cur.file_name != rel or cur.checksum != digest):
                        self.cat.index.rollback()
                        return False
                    row = IndexRow(
                        meta=p.meta,
                        file_name=rel,
                        file_bytes=size,
                        checksum=digest,
                        created=cur.created if cur is not None else now,
                        last_access=now,
                        expiry=None if ttl is None else now + ttl,
                        hits=cur.hits if cur is not None else 0,
                        had_session=p.had_session or (cur is not None and cur.had_session),
                    )
                    self.cat.index.upsert(row)
                    pin = max(self.cat.pins.get(h, 0.0),
                              cur.pinned_until if cur is not None and cur.pinned_until else 0.0)
                    if pin > now:  # a pin asked before the row existed, or the row's own
                        self.cat.index.pin([h], pin)
                    self.cat.index.add_sessions(h, p.sessions)
                    if not dedup:
                        self.cat.add_written(size)
                    done.append((p, cur, rel))
                if evict:
                    keep = {bytes(p.meta.block_hash) for p, _, _ in done}
                    excess = self.cat.index.totals()[1] - self.cat.budget()
                    if excess > 0:
                        for h, old, size, is_pinned in self.cat.index.lru(len(keep) + 256, now):
                            if excess <= 0:
                                break
                            if h not in keep:
                                victims.append((h, old, size))
                                excess -= size
                                pinned += is_pinned
                        self.cat.index.delete(h for h, _, _ in victims)
                self.cat.index.commit()
            except sqlite3.Error as e:
                self.cat.index.rollback()
                self.status.index_error(e)
                for p, _, rel, _ in live:
                    self.queued.forget(p)
                    if not dedup:
                        self.cat.remove_files([rel])
                return True
            for p, cur, rel in done:
                self.queued.forget(p)
                self.cat.pins.pop(bytes(p.meta.block_hash), None)
                self.status.counts["dedup" if dedup else "spills"] += 1
                if cur is not None and cur.file_name != rel:
                    replaced.append(cur.file_name)
            if victims:
                self.status.counts[self.cat.eviction_counter()] += len(victims)
                self.status.counts["evictions_pinned"] += pinned
                replaced.extend(rel for _, rel, _ in victims)
            self.cat.blocks, self.cat.bytes_stored = self.cat.index.totals()
            self.status.recovered()
        self.cat.remove_files(replaced)  # still under the shared DirLock: no repair between
        return True
