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
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

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
