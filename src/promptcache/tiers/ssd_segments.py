"""The SSD tier's segment files: blocks appended as records (``MAGIC``, length,
xxh3-128, the encoded block) to ``segments/<time>-<pid>-<rand>.seg``; a row names
its bytes as ``segments/<name>.seg@<offset>`` (``file_bytes`` and ``checksum`` as
for a block file). A writer holds an exclusive ``flock`` on the segment it appends
to, so every process knows which segments are in use: only a segment no one holds
has its torn tail (bytes past its last row: a crash mid-append) truncated, or is
removed once no row names it. A chain's blocks are served as verified views of the
mapped segment, runs of adjacent records faulted in in turn (``MADV_POPULATE_READ``:
an error, not a SIGBUS; ``read_many``). A view stays valid after an unlink,
not after a cut (only bytes past a segment's last row are cut): callers copy what
they keep."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import secrets
import struct
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..codec import checksum_matches
from . import ssd_files as files

SEG_DIR = "segments"
SUFFIX = ".seg"
MAGIC = b"PCS1"
HEAD = struct.Struct("<4sQ16s")  # magic, data length, xxh3-128 digest of the data
RUN_BYTES = 8 << 20  # a coalesced read stops growing past this
RUN_BLOCKS = 400  # ... and this many blocks
READERS = 4  # pread threads, for a segment that is not mapped
# Linux 5.14+ (an older kernel refuses it: pread); called through libc, as ctypes releases
# the GIL and mmap.madvise holds it through the disk read, stalling every other thread
MADV_POPULATE_READ = 22 if sys.platform == "linux" else None
_madvise = ctypes.CDLL(None, use_errno=True).madvise
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_madvise.restype = ctypes.c_int
Payload = bytes | memoryview  # a block read: its bytes, or a view of its mapped segment


def is_segment(rel: str) -> bool:
    return rel.startswith(SEG_DIR + "/")


def split_ref(ref: str) -> tuple[str, int]:
    """``segments/x.seg@123`` -> (``segments/x.seg``, 123)."""
    rel, _, offset = ref.rpartition("@")
    return rel, int(offset)


def in_use(path: Path) -> bool:
    """True if a writer (of any process, this one included) appends to ``path``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)  # (releases the probe's lock)
    return False


class SegmentWriter:
    """Appends records to this process's current segment (a new one past
    ``max_bytes``). Not thread-safe: the tier's writer thread owns it."""

    def __init__(self, root: Path, *, max_bytes: int, fsync: bool) -> None:
        self.root, self.max_bytes, self.fsync = root, max_bytes, fsync
        self.fd: int | None = None
        self.rel = ""
        self.size = 0

    def _rotate(self, dirlock: files.DirLock) -> None:
        self.close()
        folder = self.root / SEG_DIR
        name = f"{int(time.time() * 1000):x}-{os.getpid()}-{secrets.token_hex(4)}{SUFFIX}"
        with dirlock.shared():  # a repair never sees it unlocked and without rows
            files.ensure_dir(folder, fsync=self.fsync)
            fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                         0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            if self.fsync:
                files.fsync_dir(folder)
        self.fd, self.rel, self.size = fd, f"{SEG_DIR}/{name}", 0

    def append(self, blocks: Sequence[tuple[Payload, str]], dirlock: files.DirLock) -> list[str]:
        """Append ``(data, xxh3 hex)`` records, fsynced; returns each block's row name.
        On an error the segment is cut back to where it was (raises OSError)."""
        if self.fd is None or self.size >= self.max_bytes:
            self._rotate(dirlock)
        fd = self.fd
        if fd is None:
            raise OSError(errno.EBADF, "no segment open")
        start, refs, parts = self.size, [], []
        pos = start
        for data, digest in blocks:
            parts += [HEAD.pack(MAGIC, len(data), bytes.fromhex(digest)), data]
            refs.append(f"{self.rel}@{pos + HEAD.size}")
            pos += HEAD.size + len(data)
        try:
            _pwrite_all(fd, parts, start)
            if self.fsync:
                os.fdatasync(fd)
        except OSError:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass
            raise
        self.size = pos
        return refs

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # (releases its lock: the segment is no one's now)
            self.fd = None


def _pwrite_all(fd: int, parts: list[Payload], offset: int) -> None:
    for part in parts:
        view = memoryview(part)
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n


# a read of one block: (its position in the answer, row name, length, xxh3 hex)
Want = tuple[int, str, int, str]


def runs(wants: Sequence[Want]) -> list[tuple[str, list[tuple[int, int, int, str]]]]:
    """Group by segment, then into runs of adjacent records (one read each), a run
    growing to ``RUN_BYTES``: ``(segment, [(i, offset, length, digest)])``."""
    by_seg: dict[str, list[tuple[int, int, int, str]]] = {}
    for i, ref, length, digest in wants:
        rel, off = split_ref(ref)
        by_seg.setdefault(rel, []).append((i, off, length, digest))
    out: list[tuple[str, list[tuple[int, int, int, str]]]] = []
    for rel, items in by_seg.items():
        items.sort(key=lambda t: t[1])
        cur: list[tuple[int, int, int, str]] = []
        for it in items:
            if cur and (it[1] != cur[-1][1] + cur[-1][2] + HEAD.size or len(cur) >= RUN_BLOCKS
                        or it[1] + it[2] - cur[0][1] > RUN_BYTES):
                out.append((rel, cur))
                cur = []
            cur.append(it)
        out.append((rel, cur))
    return out


def _read_run(path: Path, run: list[tuple[int, int, int, str]]) -> list[tuple[int, Payload | None]]:
    """A run's blocks read with one ``pread`` each (a segment that cannot be
    mapped, or a run it cannot populate), each verified: None for a short read or
    a checksum mismatch. Raises OSError."""
    out: list[tuple[int, Payload | None]] = []
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for i, off, length, digest in run:
            data = os.pread(fd, length, off)
            out.append((i, data if len(data) == length and checksum_matches(data, digest)
                        else None))
    finally:
        os.close(fd)
    return out


def _map(path: Path) -> mmap.mmap | None:
    """``path`` mapped read-only up to its current size (None: empty). Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        return mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else None
    finally:
        os.close(fd)  # (the map keeps its own)


def _view_run(path: Path, m: mmap.mmap | None, run: list[tuple[int, int, int, str]]
              ) -> list[tuple[int, Payload | None]]:
    """A run's blocks as verified views of the mapped segment: no copy, no fresh
    memory. Only a run wholly inside the map is touched, after ``MADV_POPULATE_READ``
    has faulted it in (a read error, or a file cut since it was mapped, fails it with
    EFAULT, not a SIGBUS); otherwise it is read with ``pread``."""
    start, end = run[0][1] - run[0][1] % mmap.PAGESIZE, run[-1][1] + run[-1][2]
    if m is None or end > len(m) or MADV_POPULATE_READ is None:
        return _read_run(path, run)
    if _madvise(np.frombuffer(m, np.uint8).ctypes.data + start, end - start,
                MADV_POPULATE_READ) != 0:
        return _read_run(path, run)
    mv = memoryview(m)
    out: list[tuple[int, Payload | None]] = []
    for i, off, length, digest in run:
        view = mv[off:off + length]
        out.append((i, view if checksum_matches(view, digest) else None))
    return out


def _mapped(root: Path, rels: Iterable[str]) -> dict[str, mmap.mmap | None]:
    """Each segment mapped (None: empty or unmappable: ``pread`` judges it). No
    ``MADV_WILLNEED``: it cost three times the CPU of the read (measured)."""
    maps: dict[str, mmap.mmap | None] = {}
    for rel in rels:
        try:
            maps[rel] = _map(root / rel)
        except OSError:
            maps[rel] = None
    return maps


def _now(path: Path, m: mmap.mmap | None, run: list[tuple[int, int, int, str]]
         ) -> Future[list[tuple[int, Payload | None]]]:
    fut: Future[list[tuple[int, Payload | None]]] = Future()
    try:
        fut.set_result(_view_run(path, m, run))
    except OSError as e:
        fut.set_exception(e)
    return fut


def read_many(root: Path, wants: Sequence[Want], pool: ThreadPoolExecutor | None
              ) -> dict[int, Payload | None | OSError]:
    """The verified bytes of each wanted block (a read-only view of the mapped
    segment, valid after the segment is unlinked; None: damaged or cut short; an
    ``OSError``: its segment could not be read); a segment that is not mapped is read
    with pread on ``pool`` (None: here)."""
    planned = runs(wants)
    maps = _mapped(root, {rel for rel, _ in planned})
    # runs of a mapped segment one after the other here (threads only convoy on the GIL
    # that each populate and hash lets go); the others read with pread on ``pool``
    jobs = [(run, pool.submit(_read_run, root / rel, run)) for rel, run in planned
            if maps[rel] is None and pool is not None]
    jobs += [(run, _now(root / rel, maps[rel], run)) for rel, run in planned
             if maps[rel] is not None or pool is None]
    out: dict[int, Payload | None | OSError] = {}
    for run, fut in jobs:
        try:
            for i, data in fut.result():
                out[i] = data
        except FileNotFoundError:
            for it in run:
                out[it[0]] = None
        except OSError as e:
            for it in run:
                out[it[0]] = e
    return out


def records(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(offset, data)`` of each intact record from the start of a segment, up to
    the first torn or damaged one (a crash mid-append)."""
    with open(path, "rb") as f:
        pos = 0
        while True:
            head = f.read(HEAD.size)
            if len(head) < HEAD.size:
                return
            magic, length, digest = HEAD.unpack(head)
            if magic != MAGIC:
                return
            data = f.read(length)
            if len(data) < length or not checksum_matches(data, digest.hex()):
                return
            yield pos + HEAD.size, data
            pos += HEAD.size + length


def segment_files(root: Path) -> Iterator[tuple[str, int]]:
    """``(row name prefix, size)`` of every segment file."""
    folder = root / SEG_DIR
    if not folder.is_dir():
        return
    for p in sorted(folder.iterdir()):
        if p.name.endswith(SUFFIX):
            try:
                yield f"{SEG_DIR}/{p.name}", p.stat().st_size
            except FileNotFoundError:
                continue
