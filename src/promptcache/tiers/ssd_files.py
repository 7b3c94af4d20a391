"""The SSD tier's on-disk layout and crash-safe file operations (docs/cache.md):
``index.sqlite``, ``lock`` (DirLock), ``quarantine/``, and content-addressed block files
``<namespace>/<tenant>/blocks/<2 hex>/<hash hex>[.<tag>].safetensors``, each written to a
temp file (its writer's pid in the name), fsynced and published with ``os.link`` under a
name nobody holds; an old file stays valid until the new index row is committed."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from ..codec import checksum_matches

log = logging.getLogger(__name__)

INDEX_NAME = "index.sqlite"
QUARANTINE_DIR = "quarantine"
TEMP_PREFIX = ".tmp-"
SUFFIX = ".safetensors"
ALT_SUFFIX = ".1.safetensors"
_NO_NAMESPACE = "_"
_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_BLOCK_FILE = re.compile(r"^[0-9a-f]{64}(\.[0-9a-z]{1,16})?\.safetensors$")
_TEMP_FILE = re.compile(r"^\.tmp-.*\.(\d+)\.[0-9a-f]+$")
LOCK_NAME = "lock"
# a temp file older than this is a leftover even if its pid is alive (pids are reused)
STALE_TEMP_S = 3600.0


def _folder_name(value: str, what: str) -> str:
    if value == "":
        return _NO_NAMESPACE
    if not _SAFE.match(value):
        raise ValueError(f"{what} {value!r} cannot name a folder (letters, digits, '.', '_', '-')")
    return value


def block_rel_path(namespace_key: str, tenant: str, hash_hex: str) -> str:
    """Path of a block file relative to the tier root (always '/'-separated)."""
    ns = _folder_name(namespace_key, "namespace key")
    tn = _folder_name(tenant, "tenant")
    return f"{ns}/{tn}/blocks/{hash_hex[:2]}/{hash_hex}{SUFFIX}"


def block_names(hash_hex: str) -> list[str]:
    """The two preferred file names of a block: primary, then the alternate."""
    return [hash_hex + SUFFIX, hash_hex + ALT_SUFFIX]


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


# with fsync, files this large go around the page cache (O_DIRECT, where the file system
# has it): disk speed instead of writeback (10x slower on a VM: bench/bench_shutdown.py)
DIRECT_MIN_BYTES = 1 << 20
DIRECT_ALIGN = 4096  # the memory, offset and length alignment O_DIRECT asks for
DIRECT_KEEP_BYTES = 64 << 20  # each writing thread keeps its aligned buffer up to this size
_direct = threading.local()  # .buf: that thread's aligned buffer (mapping fresh pages is slow)


def _aligned_buffer(size: int) -> mmap.mmap:
    """A page-aligned buffer of at least ``size`` bytes, this thread's own (reused)."""
    buf: mmap.mmap | None = getattr(_direct, "buf", None)
    if buf is not None and len(buf) >= size:
        return buf
    if buf is not None:
        buf.close()
        _direct.buf = None
    buf = mmap.mmap(-1, size)
    if size <= DIRECT_KEEP_BYTES:
        _direct.buf = buf
    return buf


def write_temp(folder: Path, name: str, data: bytes, *, fsync: bool) -> Path:
    """Write ``data`` to a new temp file for ``name`` in ``folder`` (with ``fsync``:
    fsynced, and ``O_DIRECT`` for large files, see ``DIRECT_MIN_BYTES``)."""
    ensure_dir(folder, fsync=fsync)
    tmp = folder / f"{TEMP_PREFIX}{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        if not (fsync and len(data) >= DIRECT_MIN_BYTES and _write_direct(tmp, data)):
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    return tmp


def _write_direct(path: Path, data: bytes) -> bool:
    """``data`` to the new file ``path`` with O_DIRECT (a padded page-aligned copy, then
    truncated) and fsynced; False, no file left, where O_DIRECT is refused."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flag, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:  # the file system has no O_DIRECT (tmpfs)
            return False
        raise
    n = len(data)
    size = -(-n // DIRECT_ALIGN) * DIRECT_ALIGN
    try:
        buf = _aligned_buffer(size)
        buf[:n] = data
        buf[n:size] = bytes(size - n)
        view = memoryview(buf)[:size]
        try:
            done = 0
            while done < size:
                done += os.write(fd, view[done:])
        finally:
            view.release()
            if getattr(_direct, "buf", None) is not buf:
                buf.close()
        os.ftruncate(fd, n)
        os.fsync(fd)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        if e.errno == errno.EINVAL:  # an alignment this device does not take
            return False
        raise
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return True


def publish(tmp: Path, names: list[str], *, fsync: bool) -> str:
    """Give ``tmp`` the first free name of ``names`` (``os.link``: never replacing a
    file), else a fresh random one; returns the name used (raises OSError)."""
    folder = tmp.parent
    used = None
    try:
        for name in names:
            try:
                os.link(tmp, folder / name)
            except FileExistsError:
                continue
            except OSError as e:
                if e.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK,
                               errno.EXDEV, errno.ENOSYS):
                    break  # no hard links here: a name nobody else can hold
                raise
            used = name
            break
        if used is None:
            stem = names[0].removesuffix(SUFFIX)
            used = f"{stem}.{uuid.uuid4().hex[:12]}{SUFFIX}"
            os.replace(tmp, folder / used)
        else:
            tmp.unlink()
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    if fsync:
        fsync_dir(folder)
    return used



def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    except OSError:
        return True
    return True


def temp_is_stale(path: Path, *, now: float | None = None, max_age_s: float = STALE_TEMP_S) -> bool:
    """A temp file left by a writer that is gone: its pid (in the name) is not a live
    process, or it is older than ``max_age_s``. A live writer's temp file is kept."""
    m = _TEMP_FILE.match(path.name)
    try:
        age = (time.time() if now is None else now) - path.stat().st_mtime
    except FileNotFoundError:
        return False
    if age > max_age_s:
        return True
    if m is None:  # not one of ours (no pid): only by age
        return False
    return not pid_alive(int(m.group(1)))


class DirLock:
    """``flock`` on ``<root>/lock``: every change to the index and files holds it shared;
    repair, ``purge`` and ``cache check --fix`` exclusively, so they never see another
    live process's half-done change. ``path=None``: a no-op lock."""

    def __init__(self, path: Path | None, *, create: bool = True) -> None:
        self.path = path
        self._fd: int | None = None
        if path is not None:
            self._fd = open_lock_fd(path, create=create)

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._held(fcntl.LOCK_SH):
            yield

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._held(fcntl.LOCK_EX):
            yield

    @contextlib.contextmanager
    def _held(self, how: int) -> Iterator[None]:
        fd = self._fd
        if fd is None:
            yield
            return
        fcntl.flock(fd, how)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def open_lock_fd(path: Path, *, create: bool) -> int:
    """A descriptor of the folder's lock file to ``flock``: read-write (created if
    ``create``), else read-only (``flock`` works on either: a lock file another user
    owns still locks). Raises OSError when neither opens."""
    if create:
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
    return os.open(path, os.O_RDONLY)


def probe_writable(root: Path) -> None:
    """Create and remove a small file in ``root``: raises OSError (``EROFS``,
    ``EACCES``, ``ENOSPC``...) if the folder cannot take a new file."""
    probe = root / f".probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.close(fd)
    os.unlink(probe)


def set_aside(root: Path, rels: list[str], stamp: int) -> int:
    """Move these files under ``quarantine/unindexed.<stamp>/`` (not proven orphans: kept
    for an operator or a rebuild to decide); returns how many moved."""
    dest_root = root / QUARANTINE_DIR / f"unindexed.{stamp}"
    moved = 0
    for rel in rels:
        dest = dest_root / rel
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(root / rel, dest)
            moved += 1
        except FileNotFoundError:
            continue
    return moved


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
    """(relative path, size, kind) of every file in a ``blocks`` folder; kind: ``block``,
    ``temp`` (a leftover) or ``other``."""
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



FADV_WILLNEED: int | None = getattr(os, "POSIX_FADV_WILLNEED", None)
FileStamp = tuple[int, int, int]  # (st_ino, st_size, st_mtime_ns)


def stamp_of(st: os.stat_result) -> FileStamp:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


# mtimes tick coarsely: a file modified this recently may change again unseen
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
        if FADV_WILLNEED is not None:  # submit the whole file at once, not window by window
            os.posix_fadvise(f.fileno(), 0, 0, FADV_WILLNEED)
        data = f.read()
    if len(data) != size or not checksum_matches(data, digest):
        return None
    return data, stamp_of(st)
