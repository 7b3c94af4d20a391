"""Opening the SSD tier's folder: its lock, then its index (``open_index``). Without the lock, or on
a folder that cannot be written, the tier is read-only; without a usable index it is off. A
corrupt or lost index is rebuilt from the block files (``ssd_recover``) under that lock only."""

from __future__ import annotations

import errno
import logging
import sqlite3
import time
from pathlib import Path

from ..config import SSDConfig
from . import ssd_files as files
from .ssd_index import SSDIndex
from .ssd_recover import recover_from_files
from .ssd_schema import IndexCorruptError, IndexOpenError
from .ssd_store import Status

log = logging.getLogger(__name__)

# what probing a folder that can be read but not written raises
READ_ONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


class Opened:
    """What opening the folder found: its lock, and what a repair did on the way
    (reported once by the next ``check``; see ``ssd_check.Repair``)."""

    def __init__(self, config: SSDConfig, status: Status) -> None:
        self.config, self.status = config, status
        self.root = Path(config.path)
        self.dirlock = files.DirLock(None)
        self.index_rebuilt = False
        self.index_corrupt = False  # the CLI's read-only open found the index unusable
        self.set_aside = self.recovered = 0

    def set_mode(self, mode: str, reason: str, *, degraded: bool = True) -> None:
        self.status.set_mode(mode, reason, degraded=degraded)


def open_index(st: Opened, read_only: bool) -> SSDIndex:
    """Open the folder: its lock, then its index (modes: see the module docstring).
    ``read_only`` (``cache check`` without ``--fix``, ``ls``, ``stats``): change nothing."""
    path = st.root / files.INDEX_NAME
    if read_only:
        return _open_read_only(st, path)
    durable = st.config.fsync
    try:
        files.ensure_dir(st.root, fsync=durable)
    except OSError as e:
        return _off(st, f"cannot create {st.root}: {e}")
    try:
        files.probe_writable(st.root)
    except OSError as e:
        if e.errno in READ_ONLY_ERRNOS:
            # a read-only file system or folder: its blocks are still served (lookups
            # and restores hit them); every write, touch and repair is skipped
            return _open_read_only(st, path, f"cache folder {st.root} is not writable: {e}")
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            return _off(st, f"cache folder {st.root} is not writable: {e}")
        # a full disk is writable once blocks are evicted (the budget in use is
        # capped by the free space): the tier stays on
        log.warning("ssd: the disk of %s is full (%s)", st.root, e)
    lock_error: OSError | None = None
    try:
        st.dirlock = files.DirLock(st.root / files.LOCK_NAME)
    except OSError as e:
        lock_error = e
    existed = path.exists()
    try:
        if existed and not path.is_file():
            raise IndexCorruptError(f"{path} is not a file")
        index = SSDIndex(path, durable=durable)
    except IndexOpenError as e:
        return _off(st, f"cannot open the index {path}: {e}")
    except IndexCorruptError as e:
        if lock_error is not None:
            return _off(st, f"the index {path} is unusable ({e}) and the folder lock "
                             f"cannot be opened ({lock_error}): not repairing it")
        log.error("ssd index %s is unusable (%s): rebuilding it under the folder lock",
                  path, e)
        with st.dirlock.exclusive():  # no other process is in the middle of a change
            return _rebuild_index(st, path, durable)
    if lock_error is not None:
        st.set_mode("read_only", f"cannot open the folder lock "
                       f"{st.root / files.LOCK_NAME}: {lock_error}")
    elif not existed:  # a lost index: the block files (if any) say what they are
        with st.dirlock.exclusive():
            try:
                _recover(st, index)
            except (sqlite3.Error, OSError) as e:
                index.close()
                return _off(st, f"cannot rebuild the lost index from the files: {e}")
    return index

def _recover(st: Opened, index: SSDIndex) -> None:
    """Rows back for the self-describing block files without one; the others set
    aside (``ssd_recover``). Caller holds the exclusive folder lock."""
    got = recover_from_files(st.root, index, now=st.status.clock(),
                             ttl=st.config.ttl_seconds, stamp=int(time.time() * 1000))
    st.recovered += got.recovered
    st.set_aside += got.set_aside
    if got.recovered or got.set_aside:
        st.index_rebuilt = True

def _open_read_only(st: Opened, path: Path, unwritable: str | None = None) -> SSDIndex:
    """The index opened read-only: asked for (the CLI's inspections, ``unwritable``
    None), or a folder that cannot be written (``unwritable`` says why: the tier
    serves read-only, reported as degraded). A folder without a usable index is off."""
    if not st.root.is_dir():
        return _off(st, f"{st.root} is not a folder")
    try:
        st.dirlock = files.DirLock(st.root / files.LOCK_NAME, create=False)
    except OSError as e:
        log.info("ssd: no folder lock to share (%s)", e)
    why = f"{unwritable}; " if unwritable is not None else ""
    try:
        if path.exists() and not path.is_file():
            raise IndexCorruptError(f"{path} is not a file")
        index = SSDIndex(path, durable=False, read_only=True)
    except IndexCorruptError as e:
        if unwritable is None:
            st.index_corrupt = True
        return _off(st, f"{why}the index {path} is unusable: {e}")
    except IndexOpenError as e:
        return _off(st, f"{why}cannot open the index {path}: {e}")
    if unwritable is None:
        st.set_mode("read_only", "opened read-only", degraded=False)
    else:
        st.set_mode("read_only", f"{unwritable}: its blocks are served read-only (no "
                                 "writes, no repairs)")
    return index

def _rebuild_index(st: Opened, path: Path, durable: bool) -> SSDIndex:
    """Caller holds the exclusive folder lock. The old index goes to quarantine;
    the new one gets the rows of the self-describing block files back, the other
    files are set aside (``quarantine/unindexed.<time>/``), never deleted: nothing
    proves them orphans."""
    try:  # another process may have rebuilt it while we waited for the lock
        if path.is_file():
            return SSDIndex(path, durable=durable)
    except (IndexCorruptError, IndexOpenError):
        pass
    st.index_rebuilt = True
    stamp = int(time.time() * 1000)
    try:
        qdir = st.root / files.QUARANTINE_DIR
        qdir.mkdir(parents=True, exist_ok=True)
        for suffix in ("", "-wal", "-shm"):
            p = st.root / (files.INDEX_NAME + suffix)
            if p.exists():
                p.replace(qdir / f"{files.INDEX_NAME}{suffix}.{stamp}")
        index = SSDIndex(path, durable=durable)
        _recover(st, index)
        return index
    except (OSError, sqlite3.Error, IndexCorruptError, IndexOpenError) as e:
        return _off(st, f"cannot rebuild the index: {e}")

def _off(st: Opened, reason: str) -> SSDIndex:
    st.set_mode("off", reason)
    return SSDIndex(Path(":memory:"), durable=False)
