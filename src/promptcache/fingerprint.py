"""The exact model fingerprint: sha256 of the canonical ``config.json`` and each safetensors file's
name, size and xxh3-128 (part of every cache namespace).

Digests are memoised in ``fingerprints.json`` by path, size, times, inode and device; a HF hub
blob's sha256 name is used without reading it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import xxhash

from .config import default_cache_dir

log = logging.getLogger(__name__)

FINGERPRINT_VERSION = 2  # 2: every byte of the weights (1 sampled 16 x 4 KB per file)
MEMO_NAME = "fingerprints.json"
MEMO_VERSION = 1
MEMO_MAX_ENTRIES = 512
CHUNK_BYTES = 8 << 20
_MAX_HEADER_BYTES = 100 * 1024 * 1024
_HF_BLOB = re.compile(r"^[0-9a-f]{64}$")
# file times are coarse: a file changed this recently is hashed but not remembered
RECENT_NS = 2_000_000_000
_memo_lock = threading.Lock()  # one process: read-modify-write of the memo file


def weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.safetensors") if p.is_file())


def _check_safetensors(path: Path, size: int) -> None:
    """A cheap sanity check (ValueError): the 8-byte header length fits the file."""
    with open(path, "rb") as f:
        raw = f.read(8)
    if len(raw) != 8:
        raise ValueError(f"{path} is not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", raw)
    if n > _MAX_HEADER_BYTES or 8 + n > size:
        raise ValueError(f"{path} is not a safetensors file (header of {n} bytes)")


def hash_file(path: Path) -> str:
    """``xxh3_128:<hex>`` of every byte of ``path``."""
    h = xxhash.xxh3_128()
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                break
            h.update(view[:n])
    return f"xxh3_128:{h.hexdigest()}"


def hub_digest(path: Path) -> str | None:
    """``sha256:<hex>`` if ``path`` links to a Hugging Face hub blob named by its content."""
    if not path.is_symlink():
        return None
    target = path.resolve()
    if target.parent.name == "blobs" and _HF_BLOB.match(target.name):
        return f"sha256:{target.name}"
    return None


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


class _Memo:
    """``fingerprints.json``: resolved path -> {stamp, digest, used}; best effort."""

    def __init__(self, folder: Path | None) -> None:
        self.path = None if folder is None else folder / MEMO_NAME
        self.entries: dict[str, dict[str, Any]] = {}
        self.dirty = False
        if self.path is None:
            return
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if isinstance(data, dict) and data.get("version") == MEMO_VERSION:
                files = data.get("files")
                if isinstance(files, dict):
                    self.entries = {str(k): v for k, v in files.items() if isinstance(v, dict)}
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:
            log.warning("ignoring the fingerprint memo %s: %s", self.path, e)

    def get(self, key: str, stamp: list[int]) -> str | None:
        e = self.entries.get(key)
        if e is None or e.get("stamp") != stamp or not isinstance(e.get("digest"), str):
            return None
        e["used"] = time.time()
        self.dirty = True
        return str(e["digest"])

    def put(self, key: str, stamp: list[int], digest: str) -> None:
        self.entries[key] = {"stamp": stamp, "digest": digest, "used": time.time()}
        self.dirty = True

    def save(self) -> None:
        if self.path is None or not self.dirty:
            return
        if len(self.entries) > MEMO_MAX_ENTRIES:  # forget the least recently used
            keep = sorted(self.entries.items(), key=lambda kv: -float(kv[1].get("used", 0)))
            self.entries = dict(keep[:MEMO_MAX_ENTRIES])
        doc = {"version": MEMO_VERSION, "files": self.entries}
        tmp = self.path.with_name(f".{MEMO_NAME}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(doc, sort_keys=True), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("cannot save the fingerprint memo %s: %s", self.path, e)
            try:
                tmp.unlink()
            except OSError:
                pass


def file_digest(path: Path, memo: _Memo) -> str:
    """The content digest of one weight file (hub blob name, memo, or a full hash)."""
    hub = hub_digest(path)
    if hub is not None:
        return hub
    real = path.resolve()
    st = os.stat(real)
    stamp = _stamp(st)
    key = str(real)
    got = memo.get(key, stamp)
    if got is not None:
        return got
    t0 = time.monotonic()
    digest = hash_file(real)
    if _stamp(os.stat(real)) != stamp:  # changed while we read it: do not remember
        raise ValueError(f"{real} changed while it was being fingerprinted")
    if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) >= RECENT_NS:
        memo.put(key, stamp, digest)
    dt = time.monotonic() - t0
    if st.st_size > 256 << 20:
        log.info("fingerprinted %s (%.0f MB in %.1f s)", real.name, st.st_size / 1e6, dt)
    return digest


def model_fingerprint(path: str | os.PathLike[str], *,
                      memo_dir: str | os.PathLike[str] | None = None, memo: bool = True) -> str:
    """Hex sha256 of a model folder's config and weights; ValueError if not a model."""
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{folder} is not a model folder (no config.json)")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file} is not valid JSON: {e}") from None
    files = weight_files(folder)
    if not files:
        raise ValueError(f"{folder} has no .safetensors weight files")
    h = hashlib.sha256(f"promptcache-model-fingerprint-v{FINGERPRINT_VERSION}\0".encode())
    h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    where = None if not memo else Path(memo_dir) if memo_dir is not None else default_cache_dir()
    with _memo_lock:
        remembered = _Memo(where)
        for wf in files:
            size = wf.stat().st_size
            _check_safetensors(wf, size)
            h.update(f"\0{wf.name}\0{size}\0{file_digest(wf, remembered)}\0".encode())
        remembered.save()
    return h.hexdigest()
