"""The SQLite index of the SSD tier (one ``index.sqlite`` in WAL mode): every
metadata question answered without touching a block; a row is committed only after
its bytes are durably in place. Not thread-safe: the tier serializes every call."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path

from .ssd_schema import (
    COLUMNS,
    KNOWN_VERSIONS,
    SCHEMA,
    SCHEMA_VERSION,
    SELECT,
    TOTALS,
    UPDATES,
    IndexCorruptError,
    IndexOpenError,
    IndexRow,
    is_corruption,
    pack_extra_keys,
    pack_tokens,
    row_to_index_row,
    statements,
)

log = logging.getLogger(__name__)

def _connect_read_only(path: Path) -> sqlite3.Connection:
    """``mode=ro`` (it sees other processes' commits), or, where SQLite cannot open
    the WAL index beside it, ``immutable=1`` (the rows of the last checkpoint)."""
    try:
        return _connect(path, "mode=ro")
    except sqlite3.Error as e:
        if is_corruption(e):
            raise
        log.info("ssd index %s: mode=ro failed (%s), opening it immutable", path, e)
        return _connect(path, "mode=ro&immutable=1")


def _connect(path: Path, query: str) -> sqlite3.Connection:
    db = sqlite3.connect(f"file:{path}?{query}", uri=True, check_same_thread=False,
                         isolation_level=None, timeout=30.0)
    try:
        db.execute("PRAGMA schema_version").fetchone()
    except sqlite3.Error:
        db.close()
        raise
    return db


class SSDIndex:
    """``read_only``: opened ``mode=ro`` or ``immutable`` (no schema change, no write);
    a missing file raises ``IndexOpenError`` instead of being created."""

    def __init__(self, path: Path, *, durable: bool = True, read_only: bool = False) -> None:
        self.path = path
        self.read_only = read_only
        try:
            if read_only:
                self._db = _connect_read_only(path)
            else:
                self._db = sqlite3.connect(
                    str(path), check_same_thread=False, isolation_level=None, timeout=30.0
                )
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
            ok = self._db.execute("PRAGMA quick_check").fetchone()
            if not ok or ok[0] != "ok":
                raise IndexCorruptError(f"quick_check failed: {ok!r}")
            if read_only:
                version = self.kv_get("schema_version")
                if version not in KNOWN_VERSIONS:
                    raise IndexCorruptError(f"unknown index schema version {version!r}")
            else:
                self._migrate()
        except sqlite3.Error as e:
            self.close()
            if is_corruption(e):
                raise IndexCorruptError(str(e)) from e
            raise IndexOpenError(str(e)) from e
        except IndexCorruptError:
            self.close()
            raise

    def quick_check(self) -> str | None:
        """None if ``PRAGMA quick_check`` passes, else what it found. Raises sqlite3.Error."""
        got = self._db.execute("PRAGMA quick_check").fetchone()
        return None if got and got[0] == "ok" else repr(got)

    def _migrate(self) -> None:
        """Create or upgrade the schema, in one write transaction (another process may
        be opening the same index at the same moment)."""
        self.begin()
        try:
            for stmt in statements(SCHEMA):
                self._db.execute(stmt)
            version = self.kv_get("schema_version")
            if version not in KNOWN_VERSIONS:
                raise IndexCorruptError(f"unknown index schema version {version!r}")
            cols = {str(r[1]) for r in self._db.execute("PRAGMA table_info(blocks)")}
            if "pinned_until" not in cols:  # version 1-2: add the column, rows kept as they are
                self._db.execute("ALTER TABLE blocks ADD COLUMN pinned_until REAL")
            self._db.execute("CREATE INDEX IF NOT EXISTS blocks_pinned ON blocks(pinned_until) "
                             "WHERE pinned_until IS NOT NULL")
            if version != SCHEMA_VERSION:
                for stmt in statements(TOTALS):
                    self._db.execute(stmt)
                self._db.execute("DELETE FROM totals")
                self._db.execute(
                    "INSERT INTO totals(id, blocks, bytes) "
                    "SELECT 0, COUNT(*), COALESCE(SUM(file_bytes), 0) FROM blocks")
                self.kv_set("schema_version", SCHEMA_VERSION)
            self.commit()
        except BaseException:
            self.rollback()
            raise

    def close(self) -> None:
        db = getattr(self, "_db", None)
        if db is not None:
            try:
                db.close()
            except sqlite3.Error:  # pragma: no cover - closing a broken handle
                log.debug("closing index failed", exc_info=True)
            self._db = None  # type: ignore[assignment]

    # -- transactions -------------------------------------------------------------

    def begin(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def commit(self) -> None:
        self._db.execute("COMMIT")

    def rollback(self) -> None:
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")

    # -- key/value ------------------------------------------------------------

    def kv_get(self, key: str) -> str | None:
        r = self._db.execute("SELECT value FROM kv WHERE key=?", (key,)).fetchone()
        return None if r is None else str(r[0])

    def kv_set(self, key: str, value: str) -> None:
        self._db.execute(
            "INSERT INTO kv(key, value) VALUES(?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
            (key, value),
        )

    # -- blocks ---------------------------------------------------------------

    def get(self, block_hash: bytes) -> IndexRow | None:
        r = self._db.execute(
            f"SELECT {SELECT} FROM blocks WHERE hash=?", (bytes(block_hash),)
        ).fetchone()
        return None if r is None else row_to_index_row(r)

    def children(self, parent_hash: bytes) -> list[IndexRow]:
        rows = self._db.execute(
            f"SELECT {SELECT} FROM blocks WHERE parent=? ORDER BY hash", (bytes(parent_hash),)
        ).fetchall()
        return [row_to_index_row(r) for r in rows]

    def child_reads(self, parent_hash: bytes, *, limit: int) -> list[tuple[bytes, str, int, str, float | None]]:
        """(hash, file_name, file_bytes, checksum, expiry) of up to ``limit`` children:
        what a read-ahead needs, without decoding whole rows."""
        rows = self._db.execute(
            "SELECT hash, file_name, file_bytes, checksum, expiry FROM blocks WHERE parent=? "
            "ORDER BY hash LIMIT ?", (bytes(parent_hash), limit)).fetchall()
        return [(bytes(r[0]), str(r[1]), int(r[2]), str(r[3]),
                 None if r[4] is None else float(r[4])) for r in rows]

    def upsert(self, row: IndexRow) -> None:
        m = row.meta
        self._db.execute(
            f"INSERT INTO blocks({COLUMNS}) "
            "VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            f"ON CONFLICT(hash) DO UPDATE SET {UPDATES}",
            (
                bytes(m.block_hash),
                bytes(m.parent_hash),
                pack_tokens(m.token_ids),
                m.start,
                pack_extra_keys(m.extra_keys),
                m.num_tokens,
                m.nbytes,
                row.file_name,
                row.file_bytes,
                row.checksum,
                m.namespace_key,
                m.tenant,
                int(m.truncatable),
                int(m.snapshot),
                row.created,
                row.last_access,
                row.expiry,
                row.hits,
                int(row.had_session),
            ),
        )

    def delete(self, hashes: Iterable[bytes]) -> None:
        items = [(bytes(h),) for h in hashes]
        self._db.executemany("DELETE FROM blocks WHERE hash=?", items)
        self._db.executemany("DELETE FROM sessions WHERE hash=?", items)

    def touch(self, updates: Iterable[tuple[bytes, float, int, float | None]]) -> None:
        """Apply batched accesses: (hash, last_access, added hits, ttl seconds or None)."""
        for h, when, hits, ttl in updates:
            self._db.execute(
                "UPDATE blocks SET last_access=max(last_access, ?), hits=hits+?, "
                "expiry=CASE WHEN ? IS NULL THEN expiry "
                "ELSE max(? + ?, COALESCE(pinned_until, 0)) END WHERE hash=?",
                (when, hits, ttl, when, ttl, bytes(h)),
            )

    def pin(self, hashes: Iterable[bytes], until: float) -> set[bytes]:
        """Pin these blocks until ``until`` (wall clock): ``pinned_until`` only grows,
        and a TTL ``expiry`` is moved to the pin's end if it is earlier (the TTL never
        removes a pinned block). Returns the hashes that have a row."""
        found: set[bytes] = set()
        for h in hashes:
            cur = self._db.execute(
                "UPDATE blocks SET pinned_until=max(COALESCE(pinned_until, 0), ?), "
                "expiry=CASE WHEN expiry IS NULL THEN NULL ELSE max(expiry, ?) END "
                "WHERE hash=?", (until, until, bytes(h)))
            if cur.rowcount:
                found.add(bytes(h))
        return found

    def pinned(self, now: float) -> tuple[int, int]:
        """(blocks, file bytes) pinned beyond ``now``."""
        r = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(file_bytes), 0) FROM blocks "
            "WHERE pinned_until IS NOT NULL AND pinned_until > ?", (now,)).fetchone()
        return int(r[0]), int(r[1])

    def totals(self) -> tuple[int, int]:
        """(blocks, bytes) of every process's blocks (kept by triggers: one row read)."""
        r = self._db.execute("SELECT blocks, bytes FROM totals WHERE id = 0").fetchone()
        return (int(r[0]), int(r[1])) if r is not None else (0, 0)

    def count(self) -> tuple[int, int]:
        """Totals counted from the rows (reads only)."""
        r = self._db.execute("SELECT COUNT(*), COALESCE(SUM(file_bytes), 0) FROM blocks").fetchone()
        return int(r[0]), int(r[1])

    def recount(self) -> tuple[int, int]:
        """Totals counted from the rows (the oracle for ``totals``; repairs them)."""
        n, b = self.count()
        if (n, b) != self.totals():
            self._db.execute("UPDATE totals SET blocks = ?, bytes = ? WHERE id = 0", (n, b))
        return n, b

    def add_written(self, nbytes: int, day: str) -> tuple[int, int]:
        """Count ``nbytes`` written (today: ``day``, UTC date) in the shared counters;
        returns (bytes written ever, bytes written on ``day``). Inside a transaction."""
        total = int(self.kv_get("bytes_written") or 0) + nbytes
        today = int(self.kv_get("write_day_bytes") or 0) if self.kv_get("write_day") == day else 0
        today += nbytes
        self.kv_set("bytes_written", str(total))
        self.kv_set("write_day", day)
        self.kv_set("write_day_bytes", str(today))
        return total, today

    def written(self, day: str) -> tuple[int, int]:
        """(bytes written ever, bytes written on ``day``) as the shared counters say."""
        total = int(self.kv_get("bytes_written") or 0)
        today = int(self.kv_get("write_day_bytes") or 0) if self.kv_get("write_day") == day else 0
        return total, today

    def iter_rows(self, where: str = "", params: tuple = ()) -> Iterator[IndexRow]:  # type: ignore[type-arg]
        sql = f"SELECT {SELECT} FROM blocks {where}"
        for r in self._db.execute(sql, params).fetchall():
            yield row_to_index_row(r)

    def names_segment(self, seg: str) -> bool:
        q = "SELECT 1 FROM blocks WHERE file_name >= ? AND file_name < ? LIMIT 1"  # <seg>@<offset>
        return self._db.execute(q, (seg + "@", seg + "A")).fetchone() is not None

    def segment_use(self) -> list[tuple[str, int]]:
        """(segment, bytes its rows name) of every segment some row names."""
        return [(str(r[0]), int(r[1])) for r in self._db.execute(
            "SELECT substr(file_name, 1, instr(file_name, '@') - 1) AS seg, SUM(file_bytes) "
            "FROM blocks WHERE file_name >= 'segments/' AND file_name < 'segments0' "
            "GROUP BY seg")]

    def move(self, moves: Iterable[tuple[bytes, str, str]]) -> None:
        """Rows that still name ``old`` name ``new`` now: ``(hash, old, new)``."""
        self._db.executemany("UPDATE blocks SET file_name=? WHERE hash=? AND file_name=?",
                             [(new, h, old) for h, old, new in moves])

    def files(self) -> list[tuple[bytes, str, int]]:
        """(hash, file name, file bytes) of every row."""
        rows = self._db.execute("SELECT hash, file_name, file_bytes FROM blocks").fetchall()
        return [(bytes(h), str(f), int(n)) for h, f, n in rows]

    def lru(self, limit: int, now: float = 0.0) -> list[tuple[bytes, str, int, bool]]:
        """Eviction order, up to ``limit`` blocks as (hash, file, bytes, pinned): the
        blocks not pinned beyond ``now``, least recently used first (ties by hash);
        then, only when fewer are left, the pinned ones, the pin that ends first
        first, a chain's tail before its head (``start`` descending), ties by hash."""
        rows = self._db.execute(
            "SELECT hash, file_name, file_bytes FROM blocks "
            "WHERE pinned_until IS NULL OR pinned_until <= ? "
            "ORDER BY last_access, hash LIMIT ?", (now, limit),
        ).fetchall()
        out = [(bytes(h), str(f), int(n), False) for h, f, n in rows]
        if len(out) < limit:
            rows = self._db.execute(
                "SELECT hash, file_name, file_bytes FROM blocks WHERE pinned_until > ? "
                "ORDER BY pinned_until, start DESC, hash LIMIT ?", (now, limit - len(out)),
            ).fetchall()
            out.extend((bytes(h), str(f), int(n), True) for h, f, n in rows)
        return out

    def expired(self, now: float) -> list[tuple[bytes, str, int]]:
        rows = self._db.execute(
            "SELECT hash, file_name, file_bytes FROM blocks "
            "WHERE expiry IS NOT NULL AND expiry <= ? ORDER BY expiry, hash",
            (now,),
        ).fetchall()
        return [(bytes(h), str(f), int(n)) for h, f, n in rows]

    def select_files(self, where: str, params: tuple) -> list[tuple[bytes, str, int]]:  # type: ignore[type-arg]
        rows = self._db.execute(
            f"SELECT hash, file_name, file_bytes FROM blocks {where}", params
        ).fetchall()
        return [(bytes(h), str(f), int(n)) for h, f, n in rows]

    # -- sessions -------------------------------------------------------------

    def add_sessions(self, block_hash: bytes, sessions: Iterable[str]) -> bool:
        """Record sessions on a block; False if the block has no row."""
        h = bytes(block_hash)
        items = [(s, h) for s in sessions]
        if not items:
            return self.get(h) is not None
        cur = self._db.execute("UPDATE blocks SET had_session=1 WHERE hash=?", (h,))
        if cur.rowcount == 0:
            return False
        self._db.executemany("INSERT OR IGNORE INTO sessions(session, hash) VALUES(?, ?)", items)
        return True

    def remove_session(self, session_id: str, tenant: str | None = None
                       ) -> list[tuple[bytes, str, int]]:
        """Drop a session from the blocks of ``tenant`` (None: every tenant); return the
        blocks left with no session."""
        if tenant is None:
            rows = self._db.execute(
                "SELECT hash FROM sessions WHERE session=?", (session_id,)).fetchall()
        else:
            rows = self._db.execute(
                "SELECT s.hash FROM sessions s JOIN blocks b ON b.hash = s.hash "
                "WHERE s.session=? AND b.tenant=?", (session_id, tenant)).fetchall()
        hashes = [bytes(r[0]) for r in rows]
        self._db.executemany("DELETE FROM sessions WHERE session=? AND hash=?",
                             [(session_id, h) for h in hashes])
        orphaned: list[tuple[bytes, str, int]] = []
        for h in hashes:
            left = self._db.execute("SELECT 1 FROM sessions WHERE hash=? LIMIT 1", (h,)).fetchone()
            if left is None:
                r = self._db.execute(
                    "SELECT hash, file_name, file_bytes FROM blocks WHERE hash=? AND had_session=1",
                    (h,),
                ).fetchone()
                if r is not None:
                    orphaned.append((bytes(r[0]), str(r[1]), int(r[2])))
        return orphaned

    def sessions_of(self, block_hash: bytes) -> list[str]:
        rows = self._db.execute(
            "SELECT session FROM sessions WHERE hash=? ORDER BY session", (bytes(block_hash),)
        ).fetchall()
        return [str(r[0]) for r in rows]

    def sessions(self, tenant: str | None = None) -> list[tuple[str, str, int, int, float]]:
        """(tenant, session, blocks, file bytes, last use) per session, most recently
        used first; last use is the latest ``last_access`` of its blocks."""
        where, params = ("WHERE b.tenant=?", (tenant,)) if tenant is not None else ("", ())
        rows = self._db.execute(
            "SELECT b.tenant, s.session, COUNT(*), SUM(b.file_bytes), MAX(b.last_access) "
            f"FROM sessions s JOIN blocks b ON b.hash = s.hash {where} "
            "GROUP BY b.tenant, s.session ORDER BY MAX(b.last_access) DESC, s.session",
            params).fetchall()
        return [(str(t), str(sid), int(n), int(nb), float(la)) for t, sid, n, nb, la in rows]

    def tenants(self) -> list[tuple[str, int, int]]:
        rows = self._db.execute(
            "SELECT tenant, COUNT(*), SUM(file_bytes) FROM blocks GROUP BY tenant ORDER BY tenant"
        ).fetchall()
        return [(str(t), int(n), int(b)) for t, n, b in rows]
