"""The vision-embedding cache: image digest -> the tower's features (engine thread only), in RAM
(LRU) and optionally as verified safetensors files via a bounded writer queue; a bad file is a miss.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

logger = logging.getLogger(__name__)

FORMAT = "promptcache-vision-v1"
WRITE_QUEUE = 64  # feature files waiting for the writer thread


@dataclass
class VisionCacheStats:
    lookups: int = 0
    ram_hits: int = 0
    ssd_hits: int = 0
    misses: int = 0
    tower_calls: int = 0
    entries: int = 0
    bytes: int = 0
    budget_bytes: int = 0
    evictions: int = 0
    ssd_writes: int = 0
    ssd_errors: int = 0  # unreadable / corrupt files (read on the engine thread)
    ssd_write_errors: int = 0  # failed writes (writer thread)
    ssd_dropped: int = 0  # writes dropped because the writer queue was full
    dropped_too_large: int = 0

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class VisionCache:
    """digest -> features ``[tokens, hidden]`` (mx arrays), RAM LRU + optional folder."""

    def __init__(self, budget_bytes: int, folder: str | os.PathLike[str] | None = None
                 ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"vision cache budget must be >= 0, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self.base = Path(folder) if folder is not None else None
        self.folder: Path | None = None  # base/<model fingerprint>, set by bind_model
        self._ram: OrderedDict[bytes, mx.array] = OrderedDict()
        self._queue: queue.Queue[tuple[bytes, np.ndarray] | None] = queue.Queue(WRITE_QUEUE)
        self._writer: threading.Thread | None = None
        self._bytes = 0
        self.counters = VisionCacheStats(budget_bytes=self.budget_bytes)

    def bind_model(self, fingerprint: str) -> None:
        """The folder becomes ``<base>/<fingerprint[:32]>`` (uncreatable: RAM only, counted)."""
        if self.base is not None:
            folder = self.base / fingerprint[:32]
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                logger.error("vision cache folder %s unusable (%s): RAM only", folder, e)
                self.counters.ssd_errors += 1
                self.folder = None
                return
            self.folder = folder

    def __len__(self) -> int:
        return len(self._ram)

    def stats(self) -> VisionCacheStats:
        c = self.counters
        c.entries, c.bytes = len(self._ram), self._bytes
        return c


    def get(self, digest: bytes) -> mx.array | None:
        """The features of ``digest`` (RAM, then the folder), or None (a miss)."""
        self.counters.lookups += 1
        feats = self._ram.get(digest)
        if feats is not None:
            self._ram.move_to_end(digest)
            self.counters.ram_hits += 1
            return feats
        feats = self._read(digest)
        if feats is not None:
            self.counters.ssd_hits += 1
            self._keep(digest, feats)
            return feats
        self.counters.misses += 1
        return None

    def put(self, digest: bytes, feats: mx.array) -> None:
        """Store new features (RAM; written through to the folder when there is one)."""
        mx.eval(feats)
        self._keep(digest, feats)
        if self.folder is not None:
            self._enqueue(digest, np.array(feats.astype(mx.float32)))

    def _keep(self, digest: bytes, feats: mx.array) -> None:
        size = int(feats.nbytes)
        if size > self.budget_bytes:
            self.counters.dropped_too_large += 1
            return
        old = self._ram.pop(digest, None)
        if old is not None:
            self._bytes -= int(old.nbytes)
        self._ram[digest] = feats
        self._bytes += size
        while self._bytes > self.budget_bytes:
            _, gone = self._ram.popitem(last=False)
            self._bytes -= int(gone.nbytes)
            self.counters.evictions += 1

    def clear(self) -> None:
        """Drop the RAM entries (the folder stays)."""
        self._ram.clear()
        self._bytes = 0


    def _path(self, digest: bytes) -> Path:
        if self.folder is None:
            raise RuntimeError("the vision cache has no folder")
        return self.folder / f"{digest.hex()}.safetensors"

    def _enqueue(self, digest: bytes, arr: np.ndarray) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                            name="promptcache-vision-writer")
            self._writer.start()
        try:
            self._queue.put_nowait((digest, arr))
        except queue.Full:
            self.counters.ssd_dropped += 1

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued feature file is written."""
        if self._writer is not None:
            self._queue.join()

    def close(self) -> None:
        """Flush and stop the writer thread (the RAM entries stay usable)."""
        if self._writer is not None:
            self._queue.join()
            self._queue.put(None)
            self._writer.join()
            self._writer = None

    def _write(self, digest: bytes, arr: np.ndarray) -> None:
        from safetensors.numpy import save

        try:
            data = arr.tobytes()
            meta = {"format": FORMAT, "digest": digest.hex(),
                    "sha256": hashlib.sha256(data).hexdigest()}
            blob = save({"features": arr}, metadata=meta)
            path = self._path(digest)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            self.counters.ssd_writes += 1
        except Exception:
            logger.warning("writing vision features failed", exc_info=True)
            self.counters.ssd_write_errors += 1

    def _read(self, digest: bytes) -> mx.array | None:
        if self.folder is None:
            return None
        path = self._path(digest)
        if not path.is_file():
            return None
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="numpy") as f:
                meta: dict[str, Any] = f.metadata() or {}
                arr = f.get_tensor("features")
            if (meta.get("format") != FORMAT or meta.get("digest") != digest.hex()
                    or hashlib.sha256(arr.tobytes()).hexdigest() != meta.get("sha256")):
                raise ValueError("checksum or digest mismatch")
            return mx.array(arr)
        except Exception:
            logger.warning("vision features file %s is unreadable; removed", path, exc_info=True)
            self.counters.ssd_errors += 1
            path.unlink(missing_ok=True)
            return None
