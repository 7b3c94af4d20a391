"""The SSD tier's verified read-ahead: the next blocks of a chain read and checked on
worker threads (``ReadAhead``), and kernel read hints (``posix_fadvise(WILLNEED)``)."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from pathlib import Path

from . import ssd_files as files


def _willneed(path: Path) -> None:
    if files.FADV_WILLNEED is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, files.FADV_WILLNEED)
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
    future: Future[tuple[bytes, files.FileStamp] | None]


class ReadAhead:
    """Reads and verifies the next blocks of a chain on worker threads while the caller
    uses the current one. ``take`` hands a block over only if it was read from the file the
    row names now, matched its checksum and the file is unchanged since; else None (the caller
    reads it itself). Bounded by ``max_blocks`` and ``max_bytes``; untaken blocks go after ``ttl_s``."""

    def __init__(self, *, workers: int = 2, max_blocks: int = 4, max_bytes: int = 256 << 20,
                 ttl_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        if workers < 1 or max_blocks < 1 or max_bytes < 1:
            raise ValueError("read-ahead needs at least one worker, block and byte")
        self.max_blocks, self.max_bytes, self.ttl_s = max_blocks, max_bytes, ttl_s
        self._clock = clock
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
        now = self._clock()
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
            fut = self._pool.submit(files.read_verified, path, size, digest)
            self._entries[block_hash] = _Ahead(file_name, digest, size, now, fut)
            self.counts["scheduled"] += 1
            return True

    def hint(self, path: Path) -> None:
        """Ask the kernel, from a worker thread, to start reading ``path`` (the open
        itself may wait for the disk when the folder or inode is not cached)."""
        with self._lock:
            if self._closed or files.FADV_WILLNEED is None:
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
            if got is not None and files.stamp_of(os.stat(path)) != got[1]:
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

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for h in list(self._entries):
                self._discard(h)
            pools = [p for p in (self._pool, self._hint_pool) if p is not None]
            self._pool = self._hint_pool = None
        for pool in pools:
            pool.shutdown(wait=True, cancel_futures=True)
