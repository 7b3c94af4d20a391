"""Rebuilding the SSD tier's index from its self-describing block files and segment records: each
verified file (hash re-derived, xxh3-128, its place) gets its row again; anything else is set
aside in ``quarantine/unindexed.<time>/``, never deleted. The caller holds the folder's
exclusive lock and the tier's write lock."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ..codec import checksum, decode
from ..errors import CorruptBlockError, UnsupportedFormatError
from . import ssd_files as files
from . import ssd_segments as segments
from .ssd_index import SSDIndex
from .ssd_schema import IndexRow

log = logging.getLogger(__name__)


@dataclass
class Recovery:
    recovered: int = 0  # rows rebuilt from self-describing files
    set_aside: int = 0  # files kept in quarantine/unindexed.<stamp>/


def _describe(root: Path, rel: str, now: float, ttl: float | None
              ) -> tuple[IndexRow, tuple[str, ...]] | None:
    """The row (and sessions) a block file describes, if it proves them; else None."""
    path = root / rel
    try:
        data = path.read_bytes()
        mtime = os.stat(path).st_mtime
    except OSError as e:
        log.warning("ssd recover: cannot read %s: %s", rel, e)
        return None
    return _row(data, rel, mtime, now, ttl, placed=True)


def _row(data: bytes, rel: str, mtime: float, now: float, ttl: float | None, *, placed: bool
         ) -> tuple[IndexRow, tuple[str, ...]] | None:
    """The row of a verified self-describing block (``placed``: a block file, which
    must sit where its namespace, tenant and hash say)."""
    try:
        desc = decode(data, verify=True).desc
    except UnsupportedFormatError as e:
        log.warning("ssd recover: %s is a block of an older format (%s)", rel, e)
        return None
    except CorruptBlockError as e:
        log.warning("ssd recover: %s is not a readable block or fails its digests (%s)", rel, e)
        return None
    m = desc.meta
    hx = bytes(m.block_hash).hex()
    try:
        where = files.block_rel_path(m.namespace_key, m.tenant, hx).rsplit("/", 1)[0]
    except ValueError:
        return None
    folder, _, name = rel.rpartition("/")
    if placed and (folder != where or not name.startswith(hx)):
        log.warning("ssd recover: %s is not where its description puts it", rel)
        return None
    row = IndexRow(meta=m, file_name=rel, file_bytes=len(data), checksum=checksum(data),
                   created=mtime, last_access=mtime,
                   expiry=None if ttl is None else now + ttl, hits=0,
                   had_session=bool(desc.sessions))
    return row, desc.sessions


def recover_from_files(root: Path, index: SSDIndex, *, now: float, ttl: float | None,
                       stamp: int) -> Recovery:
    """Give every block file without a row its row back, or set it aside. Raises
    sqlite3.Error (the transaction rolled back, nothing set aside)."""
    have = {rel for _h, rel, _n in index.files()}
    seen: set[bytes] = set()
    rows: list[tuple[IndexRow, tuple[str, ...]]] = []
    aside: list[str] = []
    for rel, _size, kind in files.scan(root):
        if kind == "temp" or rel in have:
            continue
        got = _describe(root, rel, now, ttl) if kind == "block" else None
        if got is None or bytes(got[0].meta.block_hash) in seen or index.get(
                bytes(got[0].meta.block_hash)) is not None:
            aside.append(rel)
            continue
        seen.add(bytes(got[0].meta.block_hash))
        rows.append(got)
    for seg, _size in segments.segment_files(root):  # every intact record of a segment
        if segments.in_use(root / seg):
            continue
        mtime = os.stat(root / seg).st_mtime
        for offset, data in segments.records(root / seg):
            ref = f"{seg}@{offset}"
            got = None if ref in have else _row(data, ref, mtime, now, ttl, placed=False)
            if got is None or bytes(got[0].meta.block_hash) in seen or index.get(
                    bytes(got[0].meta.block_hash)) is not None:
                continue  # (bytes no row names: dead, cut or removed by the next check)
            seen.add(bytes(got[0].meta.block_hash))
            rows.append(got)
    if rows:
        index.begin()
        try:
            for row, sessions in rows:
                index.upsert(row)
                index.add_sessions(bytes(row.meta.block_hash), set(sessions))
            index.commit()
        except BaseException:
            index.rollback()
            raise
    out = Recovery(recovered=len(rows), set_aside=files.set_aside(root, aside, stamp))
    if out.recovered or out.set_aside:
        log.warning("ssd: index rebuilt from the block files: %d block(s) recovered, %d "
                    "file(s) set aside in %s/unindexed.%d/", out.recovered, out.set_aside,
                    files.QUARANTINE_DIR, stamp)
    return out
