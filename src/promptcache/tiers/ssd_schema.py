"""The SSD index's schema and row format: the SQL, the ``IndexRow`` a row reads as,
the packing of token ids and extra keys, and the errors an index open can raise."""

from __future__ import annotations

import sqlite3
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ..hashing import BlockHash
from ..meta import BlockMeta

SCHEMA_VERSION = "3"  # 2: totals kept by triggers (shared by every process); 3: pinned_until
KNOWN_VERSIONS = (None, "1", "2", SCHEMA_VERSION)

SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (
    hash BLOB PRIMARY KEY,
    parent BLOB NOT NULL,
    token_ids BLOB NOT NULL,
    start INTEGER NOT NULL,
    extra_keys BLOB NOT NULL,
    num_tokens INTEGER NOT NULL,
    nbytes INTEGER NOT NULL,
    file_name TEXT NOT NULL,
    file_bytes INTEGER NOT NULL,
    checksum TEXT NOT NULL,
    namespace_key TEXT NOT NULL,
    tenant TEXT NOT NULL,
    truncatable INTEGER NOT NULL,
    snapshot INTEGER NOT NULL,
    created REAL NOT NULL,
    last_access REAL NOT NULL,
    expiry REAL,
    hits INTEGER NOT NULL DEFAULT 0,
    had_session INTEGER NOT NULL DEFAULT 0,
    pinned_until REAL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS blocks_parent ON blocks(parent);
CREATE INDEX IF NOT EXISTS blocks_last_access ON blocks(last_access);
CREATE INDEX IF NOT EXISTS blocks_tenant ON blocks(tenant);
CREATE INDEX IF NOT EXISTS blocks_file ON blocks(file_name);
CREATE INDEX IF NOT EXISTS blocks_expiry ON blocks(expiry) WHERE expiry IS NOT NULL;
CREATE TABLE IF NOT EXISTS sessions (
    session TEXT NOT NULL,
    hash BLOB NOT NULL,
    PRIMARY KEY (session, hash)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS sessions_hash ON sessions(hash);
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
"""

# Block and byte totals maintained by SQLite itself, in the same transaction as the
# change, so every process sharing the folder sees (and enforces the budget on) the
# same numbers. Rows change only by INSERT, UPDATE (upsert) and DELETE.
TOTALS = """
CREATE TABLE IF NOT EXISTS totals (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    blocks INTEGER NOT NULL,
    bytes INTEGER NOT NULL
);
CREATE TRIGGER IF NOT EXISTS totals_insert AFTER INSERT ON blocks BEGIN
    UPDATE totals SET blocks = blocks + 1, bytes = bytes + NEW.file_bytes WHERE id = 0;
END;
CREATE TRIGGER IF NOT EXISTS totals_delete AFTER DELETE ON blocks BEGIN
    UPDATE totals SET blocks = blocks - 1, bytes = bytes - OLD.file_bytes WHERE id = 0;
END;
CREATE TRIGGER IF NOT EXISTS totals_update AFTER UPDATE OF file_bytes ON blocks BEGIN
    UPDATE totals SET bytes = bytes - OLD.file_bytes + NEW.file_bytes WHERE id = 0;
END;
"""

COLUMNS = (
    "hash, parent, token_ids, start, extra_keys, num_tokens, nbytes, file_name, file_bytes, "
    "checksum, namespace_key, tenant, truncatable, snapshot, created, last_access, expiry, "
    "hits, had_session"
)


def statements(script: str) -> list[str]:
    """Split a script of CREATE statements (triggers end with ``END;``)."""
    out: list[str] = []
    cur: list[str] = []
    for line in script.strip().splitlines():
        cur.append(line)
        text = "\n".join(cur).strip()
        if text.endswith(";") and (not text.upper().startswith("CREATE TRIGGER")
                                   or text.upper().endswith("END;")):
            out.append(text)
            cur = []
    return out


# ``pinned_until`` (``prompt_cache_retention: 24h``) is read with every row but never
# written by ``upsert``: a re-write of a block keeps its pin; only ``pin`` sets it.
SELECT = COLUMNS + ", pinned_until"

UPDATES = ", ".join(f"{c}=excluded.{c}" for c in COLUMNS.split(", ") if c != "hash")


class IndexCorruptError(Exception):
    """index.sqlite is not a database or fails its integrity check (its rows are lost)."""


class IndexOpenError(Exception):
    """index.sqlite cannot be opened or written (permissions, a read-only file system,
    a missing file in read-only mode, a lock held too long): nothing says its rows are
    lost, so nothing may be repaired because of it."""


@dataclass(frozen=True, slots=True)
class IndexRow:
    meta: BlockMeta
    file_name: str  # relative to the tier root; a segment's bytes: "<segment>@<offset>"
    file_bytes: int
    checksum: str
    created: float
    last_access: float
    expiry: float | None
    hits: int = 0
    had_session: bool = False
    pinned_until: float | None = None  # wall-clock end of a 24 h retention pin


def pack_tokens(token_ids: Iterable[int]) -> bytes:
    return np.asarray(list(token_ids), dtype="<u4").tobytes()


def unpack_tokens(blob: bytes) -> tuple[int, ...]:
    return tuple(int(t) for t in np.frombuffer(blob, dtype="<u4").tolist())


def pack_extra_keys(keys: Iterable[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(k)) + k for k in keys)


def unpack_extra_keys(blob: bytes) -> tuple[bytes, ...]:
    out: list[bytes] = []
    i = 0
    while i < len(blob):
        (n,) = struct.unpack_from("<I", blob, i)
        out.append(bytes(blob[i + 4 : i + 4 + n]))
        i += 4 + n
    return tuple(out)


def row_to_index_row(r: tuple) -> IndexRow:  # type: ignore[type-arg]
    meta = BlockMeta(
        block_hash=BlockHash(bytes(r[0])),
        parent_hash=BlockHash(bytes(r[1])),
        token_ids=unpack_tokens(r[2]),
        start=int(r[3]),
        extra_keys=unpack_extra_keys(r[4]),
        nbytes=int(r[6]),
        truncatable=bool(r[12]),
        snapshot=bool(r[13]),
        namespace_key=r[10],
        tenant=r[11],
    )
    return IndexRow(
        meta=meta,
        file_name=r[7],
        file_bytes=int(r[8]),
        checksum=r[9],
        created=float(r[14]),
        last_access=float(r[15]),
        expiry=None if r[16] is None else float(r[16]),
        hits=int(r[17]),
        had_session=bool(r[18]),
        pinned_until=None if len(r) < 20 or r[19] is None else float(r[19]),
    )


_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26


def is_corruption(e: BaseException) -> bool:
    """True if ``e`` says the database file itself is damaged (``SQLITE_CORRUPT``:
    ``database disk image is malformed``; ``SQLITE_NOTADB``: ``file is not a
    database``); False for errors of access (unable to open, read-only, locked, disk
    I/O) and for errors of use (constraints, a closed handle)."""
    if not isinstance(e, sqlite3.DatabaseError):
        return False
    code = getattr(e, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
    text = str(e)
    return type(e) is sqlite3.DatabaseError or "malformed" in text or "not a database" in text
