"""On-disk layout of the SSD tier and its crash-safe file operations.

Layout under the tier root::

    index.sqlite                                   (+ -wal / -shm)
    quarantine/<hash hex>.<unix time>.<reason>.safetensors
    <namespace key>/<tenant>/blocks/<2 hex>/<hash hex>.safetensors
    <namespace key>/<tenant>/blocks/<2 hex>/<hash hex>.1.safetensors   (a rewrite, see below)

Files are content-addressed by block hash. A block rewritten with a different
payload (e.g. upgraded with a state snapshot) goes to the *other* of the two
names, so the old file stays valid until the new row is committed and only
then is removed. Temp files (``.tmp-*``) live in the destination folder so
``os.replace`` is atomic.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from pathlib import Path

from ..codec import checksum

log = logging.getLogger(__name__)

INDEX_NAME = "index.sqlite"
QUARANTINE_DIR = "quarantine"
TEMP_PREFIX = ".tmp-"
SUFFIX = ".safetensors"
ALT_SUFFIX = ".1.safetensors"
_NO_NAMESPACE = "_"
_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_BLOCK_FILE = re.compile(r"^[0-9a-f]{64}(\.1)?\.safetensors$")


def _folder_name(value: str, what: str) -> str:
    if value == "":
        return _NO_NAMESPACE
    if not _SAFE.match(value):
        raise ValueError(f"{what} {value!r} cannot name a folder (letters, digits, '.', '_', '-')")
    return value


def block_rel_path(namespace_key: str, tenant: str, hash_hex: str, *, alt: bool = False) -> str:
    """Path of a block file relative to the tier root (always '/'-separated)."""
    ns = _folder_name(namespace_key, "namespace key")
    tn = _folder_name(tenant, "tenant")
    name = hash_hex + (ALT_SUFFIX if alt else SUFFIX)
    return f"{ns}/{tn}/blocks/{hash_hex[:2]}/{name}"


def is_alt(rel_path: str) -> bool:
    return rel_path.endswith(ALT_SUFFIX)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_dir(path: Path, *, fsync: bool) -> None:
    """Create ``path`` (and parents); with ``fsync``, make each new entry durable."""
    if path.is_dir():
        return
    missing: list[Path] = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue
        if fsync:
            fsync_dir(d.parent)
    if not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))


def atomic_write(path: Path, data: bytes, *, fsync: bool) -> None:
    """Write ``data`` to ``path`` so that ``path`` is either absent/old or complete.

    temp file in the same folder -> write -> flush + fsync -> os.replace -> fsync folder.
    """
    folder = path.parent
    ensure_dir(folder, fsync=fsync)
    tmp = folder / f"{TEMP_PREFIX}{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    if fsync:
        fsync_dir(folder)


def remove_file(path: Path) -> bool:
    """Unlink, ignoring a file that is already gone. True if something was removed."""
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def quarantine(root: Path, path: Path, hash_hex: str, reason: str) -> Path | None:
    """Move a bad block file aside (never delete evidence). None if it is gone."""
    qdir = root / QUARANTINE_DIR
    try:
        qdir.mkdir(parents=True, exist_ok=True)
        dest = qdir / f"{hash_hex}.{int(time.time() * 1000)}.{reason}{SUFFIX}"
        os.replace(path, dest)
        return dest
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("cannot quarantine %s (%s); removing it", path, e)
        try:
            path.unlink()
        except OSError as e2:
            if e2.errno != errno.ENOENT:
                log.warning("cannot remove %s either: %s", path, e2)
        return None


def scan(root: Path) -> Iterator[tuple[str, int, str]]:
    """Every file under the namespace folders: (relative path, size, kind).

    kind is ``"block"`` (a well-named block file), ``"temp"`` (a leftover temp file)
    or ``"other"`` (anything else inside a ``blocks`` folder). Files outside the
    ``blocks`` folders are not ours and are not listed.
    """
    if not root.is_dir():
        return
    for ns_dir in sorted(root.iterdir()):
        if not ns_dir.is_dir() or ns_dir.name == QUARANTINE_DIR:
            continue
        for dirpath, dirnames, filenames in os.walk(ns_dir):
            dirnames.sort()
            for name in sorted(filenames):
                full = Path(dirpath) / name
                rel = full.relative_to(root).as_posix()
                try:
                    size = full.stat().st_size
                except FileNotFoundError:
                    continue
                if "/blocks/" not in rel:
                    continue
                if name.startswith(TEMP_PREFIX):
                    kind = "temp"
                elif _BLOCK_FILE.match(name):
                    kind = "block"
                else:
                    kind = "other"
                yield rel, size, kind


# -- verified read-ahead ------------------------------------------------------------

_FADV_WILLNEED: int | None = getattr(os, "POSIX_FADV_WILLNEED", None)
FileStamp = tuple[int, int, int]  # (st_ino, st_size, st_mtime_ns)


def stamp_of(st: os.stat_result) -> FileStamp:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


# File timestamps come from a coarse clock (one kernel tick): a file modified less
# than this long before it was read could be modified again without its mtime
# changing, so its stamp proves nothing and the read-ahead copy is not used.
STAMP_MARGIN_NS = 100_000_000


def read_verified(path: Path, size: int, digest: str) -> tuple[bytes, FileStamp] | None:
    """The file's bytes and stamp if it has ``size`` bytes hashing to ``digest`` and
    was last modified well before this read, else None (a bad file is left for the
    foreground read to quarantine). Raises OSError."""
    started = time.time_ns()
    with open(path, "rb", buffering=0) as f:
        st = os.fstat(f.fileno())
        if st.st_size != size or st.st_mtime_ns > started - STAMP_MARGIN_NS:
            return None
        if _FADV_WILLNEED is not None:  # submit the whole file at once, not window by window
            os.posix_fadvise(f.fileno(), 0, 0, _FADV_WILLNEED)
        data = f.read()
    if len(data) != size or checksum(data) != digest:
        return None
    return data, stamp_of(st)


def _willneed(path: Path) -> None:
    if _FADV_WILLNEED is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, _FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass
class _Ahead:
    file_name: str
    digest: str
    size: int
    started: float
    future: Future[tuple[bytes, FileStamp] | None]


class ReadAhead:
    """Reads and verifies the next blocks of a chain on worker threads while the
    caller uses the current one (``read`` and sha256 release the GIL, so reading,
    hashing and the caller's decode overlap on separate cores).

    ``take`` hands a block over only if it was read from the file the index row
    names now, hashed to the row's checksum, and the file's (inode, size, mtime)
    has not changed since it was read; otherwise it returns None and the caller
    reads the file itself (and quarantines it if it is bad). So every byte served
    was verified against the current row, and a file damaged after the read-ahead
    is still caught by the get that follows. Memory is bounded by ``max_blocks``
    and ``max_bytes``; a block not taken within ``ttl_s`` is dropped.
    """

    def __init__(self, *, workers: int = 2, max_blocks: int = 4, max_bytes: int = 256 << 20,
                 ttl_s: float = 5.0) -> None:
        if workers < 1 or max_blocks < 1 or max_bytes < 1:
            raise ValueError("read-ahead needs at least one worker, block and byte")
        self.max_blocks, self.max_bytes, self.ttl_s = max_blocks, max_bytes, ttl_s
        self._workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self._hint_pool: ThreadPoolExecutor | None = None  # hints must not queue behind reads
        self._lock = threading.Lock()
        self._entries: dict[bytes, _Ahead] = {}
        self._closed = False
        self.counts: Counter[str] = Counter({"scheduled": 0, "used": 0, "discarded": 0})

    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._entries

    def schedule(self, block_hash: bytes, path: Path, file_name: str, size: int, digest: str) -> bool:
        """Start reading ``path`` in the background; False if already there or full."""
        now = time.monotonic()
        with self._lock:
            if self._closed or block_hash in self._entries:
                return False
            for h, e in list(self._entries.items()):
                if now - e.started > self.ttl_s:
                    self._discard(h)
            held = sum(e.size for e in self._entries.values())
            if len(self._entries) >= self.max_blocks or held + size > self.max_bytes:
                return False
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="promptcache-ssd-read")
            fut = self._pool.submit(read_verified, path, size, digest)
            self._entries[block_hash] = _Ahead(file_name, digest, size, now, fut)
            self.counts["scheduled"] += 1
            return True

    def hint(self, path: Path) -> None:
        """Ask the kernel, from a worker thread, to start reading ``path`` (the open
        itself may wait for the disk when the folder or inode is not cached)."""
        with self._lock:
            if self._closed or _FADV_WILLNEED is None:
                return
            if self._hint_pool is None:
                self._hint_pool = ThreadPoolExecutor(1, thread_name_prefix="promptcache-ssd-hint")
            self._hint_pool.submit(_willneed, path)

    def take(self, block_hash: bytes, path: Path, file_name: str, digest: str) -> bytes | None:
        """The verified bytes of ``block_hash`` if read ahead from this very file, else None."""
        with self._lock:
            e = self._entries.pop(block_hash, None)
        if e is None:
            return None
        try:
            got = e.future.result() if e.file_name == file_name and e.digest == digest else None
            if got is not None and stamp_of(os.stat(path)) != got[1]:
                got = None
        except (OSError, CancelledError):
            got = None
        with self._lock:
            self.counts["used" if got is not None else "discarded"] += 1
        return None if got is None else got[0]

    def wait(self) -> None:
        """Wait until every scheduled read has finished (tests, benchmarks)."""
        with self._lock:
            futures = [e.future for e in self._entries.values()]
        wait_all(futures)

    def _discard(self, block_hash: bytes) -> None:
        e = self._entries.pop(block_hash)
        e.future.cancel()
        self.counts["discarded"] += 1

    def clear(self) -> None:
        with self._lock:
            for h in list(self._entries):
                self._discard(h)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for h in list(self._entries):
                self._discard(h)
            pools = [p for p in (self._pool, self._hint_pool) if p is not None]
            self._pool = self._hint_pool = None
        for pool in pools:
            pool.shutdown(wait=True, cancel_futures=True)
