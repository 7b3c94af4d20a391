"""Drop files from the page cache before a cold read (shared by the SSD benchmarks)."""

from __future__ import annotations

import os
from pathlib import Path


def drop_cache(paths: list[Path]) -> str:
    """Evict ``paths`` from the page cache; returns the method used.

    ``/proc/sys/vm/drop_caches`` needs privileges we may not have; without them every
    file is fsynced and dropped with ``posix_fadvise(DONTNEED)``.
    """
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    return drop_files(paths)


def drop_files(paths: list[Path]) -> str:
    """Evict only ``paths`` from the page cache (fsynced, then ``posix_fadvise``)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise(DONTNEED)"
