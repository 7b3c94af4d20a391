"""Opening the SSD tier's folder: its lock, then its index (``SSDTier``'s first
step; see ``ssd.py`` for the modes).

Repairs need the folder's exclusive lock: without a lock the tier serves what the
index holds, read-only; without a usable index (or a writable folder) it is off (an
empty index in memory, never reconciled against the files). A corrupt index is
rebuilt, and a lost one recovered, from the self-describing block files
(``ssd_recover``), under that lock only; the files that cannot say what they are are
set aside, never deleted.
"""

from __future__ import annotations

import errno
import logging
import sqlite3
import time
from pathlib import Path
from typing import Any

from . import ssd_files as files
from .ssd_index import IndexCorruptError, IndexOpenError, SSDIndex
from .ssd_recover import recover_from_files
from .ssd_store import SSDStore

log = logging.getLogger(__name__)


class SSDOpener(SSDStore):
    """The opening half of ``SSDTier``."""

    _index_rebuilt: bool
    _index_corrupt: bool  # the CLI's read-only open found the index unusable
    _set_aside: int
    _recovered: int

    def _open_index(self, read_only: bool) -> SSDIndex:
        """Open the folder: its lock, then its index. Repairs (rebuilding a corrupt
        index, reconcile) need the folder's exclusive lock: without a lock the tier
        serves what the index holds, read-only; without a usable index (or folder) it
        is off (an empty index in memory, never reconciled against the files).
        ``read_only`` (``cache check`` without ``--fix``, ``ls``, ``stats``): create,
        move or repair nothing."""
        path = self.root / files.INDEX_NAME
        if read_only:
            return self._open_read_only(path)
        durable = self.config.fsync
        try:
            files.ensure_dir(self.root, fsync=durable)
        except OSError as e:
            return self._off(f"cannot create {self.root}: {e}")
        try:
            files.probe_writable(self.root)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                return self._off(f"cache folder {self.root} is not writable: {e}")
            # a full disk is writable once blocks are evicted (the budget in use is
            # capped by the free space): the tier stays on
            log.warning("ssd: the disk of %s is full (%s)", self.root, e)
        lock_error: OSError | None = None
        try:
            self._dirlock = files.DirLock(self.root / files.LOCK_NAME)
        except OSError as e:
            lock_error = e
        existed = path.exists()
        try:
            if existed and not path.is_file():
                raise IndexCorruptError(f"{path} is not a file")
            index = SSDIndex(path, durable=durable)
        except IndexOpenError as e:
            return self._off(f"cannot open the index {path}: {e}")
        except IndexCorruptError as e:
            if lock_error is not None:
                return self._off(f"the index {path} is unusable ({e}) and the folder lock "
                                 f"cannot be opened ({lock_error}): not repairing it")
            log.error("ssd index %s is unusable (%s): rebuilding it under the folder lock",
                      path, e)
            with self._dirlock.exclusive():  # no other process is in the middle of a change
                return self._rebuild_index(path, durable)
        if lock_error is not None:
            self._set_mode("read_only", f"cannot open the folder lock "
                           f"{self.root / files.LOCK_NAME}: {lock_error}")
        elif not existed:  # a lost index: the block files (if any) say what they are
            with self._dirlock.exclusive():
                try:
                    self._recover(index)
                except (sqlite3.Error, OSError) as e:
                    index.close()
                    return self._off(f"cannot rebuild the lost index from the files: {e}")
        return index

    def _recover(self, index: SSDIndex) -> None:
        """Rows back for the self-describing block files without one; the others set
        aside (``ssd_recover``). Caller holds the exclusive folder lock."""
        got = recover_from_files(self.root, index, now=self._clock(),
                                 ttl=self.config.ttl_seconds, stamp=int(time.time() * 1000))
        self._recovered += got.recovered
        self._set_aside += got.set_aside
        if got.recovered or got.set_aside:
            self._index_rebuilt = True

    def _open_read_only(self, path: Path) -> SSDIndex:
        if not self.root.is_dir():
            return self._off(f"{self.root} is not a folder")
        try:
            self._dirlock = files.DirLock(self.root / files.LOCK_NAME, create=False)
        except OSError as e:
            log.info("ssd: no folder lock to share (%s)", e)
        try:
            if path.exists() and not path.is_file():
                raise IndexCorruptError(f"{path} is not a file")
            index = SSDIndex(path, durable=False, read_only=True)
        except IndexCorruptError as e:
            self._index_corrupt = True
            return self._off(f"the index {path} is unusable: {e}")
        except IndexOpenError as e:
            return self._off(f"cannot open the index {path}: {e}")
        self._set_mode("read_only", "opened read-only", degraded=False)
        return index

    def _rebuild_index(self, path: Path, durable: bool) -> SSDIndex:
        """Caller holds the exclusive folder lock. The old index goes to quarantine;
        the new one gets the rows of the self-describing block files back, the other
        files are set aside (``quarantine/unindexed.<time>/``), never deleted: nothing
        proves them orphans."""
        try:  # another process may have rebuilt it while we waited for the lock
            if path.is_file():
                return SSDIndex(path, durable=durable)
        except (IndexCorruptError, IndexOpenError):
            pass
        self._index_rebuilt = True
        stamp = int(time.time() * 1000)
        try:
            qdir = self.root / files.QUARANTINE_DIR
            qdir.mkdir(parents=True, exist_ok=True)
            for suffix in ("", "-wal", "-shm"):
                p = self.root / (files.INDEX_NAME + suffix)
                if p.exists():
                    p.replace(qdir / f"{files.INDEX_NAME}{suffix}.{stamp}")
            index = SSDIndex(path, durable=durable)
            self._recover(index)
            return index
        except (OSError, sqlite3.Error, IndexCorruptError, IndexOpenError) as e:
            return self._off(f"cannot rebuild the index: {e}")

    def _off(self, reason: str) -> SSDIndex:
        self._set_mode("off", reason)
        return SSDIndex(Path(":memory:"), durable=False)

    @property
    def mode(self) -> str:
        """``read_write``, ``read_only`` or ``off`` (see ``_set_mode``)."""
        return self._mode

    def health(self) -> dict[str, Any]:
        """Cheap (no lock, no I/O): the mode and why the tier is not fully working."""
        return {"mode": self._mode, "degraded": self._degraded_reason is not None,
                "reason": self._mode_reason or self._degraded_reason,
                "index_errors": self._counts["index_errors"]}

