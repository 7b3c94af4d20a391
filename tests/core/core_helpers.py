"""Helpers for the core tests: payload factories, a test codec and an in-memory Tier."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from promptcache.blockdesc import Description
from promptcache.cache import PromptCache
from promptcache.codec import Decoded
from promptcache.config import CacheConfig
from promptcache.errors import CorruptBlockError, TierError
from promptcache.hashing import BlockHash
from promptcache.meta import BlockMeta, Namespace
from promptcache.tiers.base import PayloadSource

BYTES_PER_TOKEN = 8  # payload: float32 [n_tokens, 2]


def payload_for(start: int, end: int, snapshot: bool) -> dict[str, np.ndarray]:
    """A payload whose values identify the tokens it covers (and the snapshot flag)."""
    x = np.arange(start, end, dtype=np.float32).reshape(-1, 1).repeat(2, axis=1)
    out = {"0.k": x}
    if snapshot:
        out["0.s.0"] = np.full((1,), float(end), dtype=np.float32)
    return out


class PayloadRecorder:
    """payload_for that records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, bool]] = []

    def __call__(self, start: int, end: int, snapshot: bool) -> dict[str, np.ndarray]:
        self.calls.append((start, end, snapshot))
        return payload_for(start, end, snapshot)


def make_cache(block_size: int = 4, budget: int = 1 << 20, **kw: Any) -> PromptCache:
    cfg_kw = {k: kw.pop(k) for k in ("ttl_seconds", "explain_history", "protect_share",
                                         "active_session_s", "max_arrays") if k in kw}
    cfg = CacheConfig(block_size=block_size, ram_budget_bytes=budget, **cfg_kw)
    kw.setdefault("encode", test_encode)
    kw.setdefault("decode", test_decode)
    return PromptCache(cfg, **kw)


def ns_of(block_size: int = 4, tenant: str = "default") -> Namespace:
    return Namespace("test-model", block_size, tenant=tenant)


def test_encode(meta: BlockMeta, sessions: Sequence[str], layout: str, buffer: np.ndarray) -> bytes:
    doc = {"hash": bytes(meta.block_hash).hex(), "layout": layout,
           "buffer": np.asarray(buffer, dtype=np.uint8).tobytes().hex()}
    return json.dumps(doc).encode()


def test_decode(data: bytes) -> Decoded:
    try:
        doc = json.loads(data)
        h = BlockHash(bytes.fromhex(doc["hash"]))
        buffer = np.frombuffer(bytes.fromhex(doc["buffer"]), dtype=np.uint8)
        layout = doc["layout"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptBlockError(f"bad test payload: {e}") from e
    meta = BlockMeta(h, BlockHash(bytes(32)), (), 0)
    return Decoded(Description(meta, (), layout, ""), buffer)


test_encode.__test__ = False  # type: ignore[attr-defined]
test_decode.__test__ = False  # type: ignore[attr-defined]


class FakeTier:
    """An in-memory lower tier following tiers.base.Tier, with failure switches."""

    def __init__(self, name: str = "ssd") -> None:
        self.name = name
        self.blocks: dict[BlockHash, tuple[BlockMeta, bytes, set[str]]] = {}
        self.fail_meta = False
        self.fail_get = False
        self.fail_put = False
        self.refuse_put = False
        self.corrupt = False
        self.gets: list[BlockHash] = []
        self.put_hits: list[int | None] = []
        self.put_timeouts: list[float | None] = []
        self.closed = False

    def get_metas(self, block_hashes: Sequence[BlockHash], *, ns: Namespace | None = None
                  ) -> list[BlockMeta | None]:
        return [self.get_meta(h) for h in block_hashes]

    def get_meta(self, block_hash: BlockHash, *, ns: Namespace | None = None) -> BlockMeta | None:
        if self.fail_meta:
            raise TierError("meta index down")
        entry = self.blocks.get(block_hash)
        return entry[0] if entry else None

    def children(self, parent_hash: BlockHash, *, ns: Namespace | None = None) -> list[BlockMeta]:
        if self.fail_meta:
            raise TierError("meta index down")
        return [m for m, _, _ in self.blocks.values() if m.parent_hash == parent_hash]

    def get(self, block_hash: BlockHash, *, ns: Namespace | None = None) -> bytes | None:
        self.gets.append(block_hash)
        if self.fail_get:
            raise TierError("disk read failed")
        entry = self.blocks.get(block_hash)
        if entry is None:
            return None
        return b"\x00garbage" if self.corrupt else entry[1]

    def put(self, meta: BlockMeta, payload: bytes | PayloadSource, sessions: Iterable[str] = (),
            hits: int | None = None, *, timeout: float | None = 0.0) -> bool:
        self.put_hits.append(hits)
        self.put_timeouts.append(timeout)
        if self.fail_put:
            raise TierError("disk full")
        if self.refuse_put:
            return False
        data = payload if isinstance(payload, bytes) else payload.encode()
        self.blocks[meta.block_hash] = (meta, data, set(sessions))
        return True

    def discard(self, block_hashes: Iterable[BlockHash], *, ns: Namespace | None = None) -> int:
        gone = [h for h in block_hashes if self.blocks.pop(h, None) is not None]
        return len(gone)

    def sessions_of(self, block_hash: BlockHash, *, ns: Namespace | None = None) -> list[str]:
        entry = self.blocks.get(block_hash)
        return sorted(entry[2]) if entry is not None else []

    def add_sessions(self, block_hash: BlockHash, sessions: Iterable[str], *,
                     ns: Namespace | None = None) -> None:
        if block_hash in self.blocks:
            self.blocks[block_hash][2].update(sessions)

    def delete_session(self, session_id: str, tenant: str | None = None) -> int:
        return len(self.delete_session_blocks(session_id, tenant))

    def delete_session_blocks(self, session_id: str, tenant: str | None = None
                              ) -> set[bytes]:
        mine = {h for h, (m, _, _) in self.blocks.items() if tenant is None or m.tenant == tenant}
        gone = {h for h in mine if self.blocks[h][2] == {session_id}}
        for h in mine:
            self.blocks[h][2].discard(session_id)
        for h in gone:
            del self.blocks[h]
        return {bytes(h) for h in gone}

    def delete_tenant(self, tenant: str | None) -> int:
        gone = [h for h, (m, _, _) in self.blocks.items() if tenant is None or m.tenant == tenant]
        for h in gone:
            del self.blocks[h]
        return len(gone)

    def stats(self) -> Mapping[str, Any]:
        return {"blocks": len(self.blocks), "bytes": sum(len(b) for _, b, _ in self.blocks.values())}

    def close(self) -> None:
        self.closed = True


class QueueTier(FakeTier):
    """A FakeTier with a bounded write queue drained by its own writer thread, which
    writes only while ``gate`` is set: a full queue, back-pressure and flush without
    timing. ``write_order`` records the written blocks' starts."""

    def __init__(self, capacity: int, name: str = "ssd") -> None:
        super().__init__(name)
        self.capacity = capacity
        self.gate = threading.Event()
        self.cond = threading.Condition()
        self.queue: list[tuple[BlockMeta, PayloadSource, set[str]]] = []
        self.in_flight = 0
        self.waiting = 0  # puts waiting for room
        self.write_order: list[int] = []
        self.encode_threads: list[str] = []
        self.lose_writes = False  # accept, then lose them (a failing disk)
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _room(self) -> bool:
        return len(self.queue) < self.capacity

    def put(self, meta: BlockMeta, payload: bytes | PayloadSource, sessions: Iterable[str] = (),
            hits: int | None = None, *, timeout: float | None = 0.0) -> bool:
        self.put_hits.append(hits)
        self.put_timeouts.append(timeout)
        if self.refuse_put:
            return False
        source = payload if not isinstance(payload, bytes) else _Bytes(payload)
        with self.cond:
            if not self._room():
                if timeout is not None and timeout <= 0:
                    return False
                self.waiting += 1
                self.cond.notify_all()
                ok = self.cond.wait_for(self._room, timeout)
                self.waiting -= 1
                if not ok:
                    return False
            self.queue.append((meta, source, set(sessions)))
            self.cond.notify_all()
            return True

    def has_room(self, timeout: float | None = 0.0) -> bool:
        with self.cond:
            if timeout is not None and timeout <= 0:
                return self._room()
            return self.cond.wait_for(self._room, timeout)

    def flush(self, timeout: float | None = None) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: not self.queue and not self.in_flight, timeout)

    def _run(self) -> None:
        while True:
            self.gate.wait()
            with self.cond:
                self.cond.wait_for(lambda: self.queue or self.stop)
                if self.stop:
                    return
                if not self.gate.is_set():
                    continue
                meta, source, sessions = self.queue.pop(0)
                self.in_flight += 1
                self.cond.notify_all()
            data = source.encode()
            self.encode_threads.append(threading.current_thread().name)
            with self.cond:
                if not self.lose_writes:
                    self.blocks[meta.block_hash] = (meta, data, sessions)
                    self.write_order.append(meta.start)
                self.in_flight -= 1
                self.cond.notify_all()

    def delete_session_blocks(self, session_id: str, tenant: str | None = None
                              ) -> set[bytes]:
        with self.cond:
            gone = {bytes(q[0].block_hash) for q in self.queue if (
                tenant is None or q[0].tenant == tenant) and q[2] == {session_id}}
            self.queue = [q for q in self.queue if not (
                (tenant is None or q[0].tenant == tenant) and q[2] == {session_id})]
            for meta, _, sessions in self.queue:
                if tenant is None or meta.tenant == tenant:
                    sessions.discard(session_id)
            self.cond.notify_all()
            return gone | super().delete_session_blocks(session_id, tenant)

    def wait_for_waiting_put(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.waiting > 0)

    def close(self) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify_all()
        self.gate.set()
        self.thread.join()
        self.closed = True


class _Bytes:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.nbytes = len(data)

    def encode(self) -> bytes:
        return self.data
