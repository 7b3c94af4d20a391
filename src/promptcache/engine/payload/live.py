"""Live session state: a finished turn's caches kept as the model's own cache objects, so the next
request extending them trims to the common prefix and prefills only what is new.

A state is taken whole (never shared); SSM states and full windows serve only exact extensions; the
blocks stay the source of truth. State bytes count in the RAM tier's budget (``hold_outside``) and
go after idle blocks (``reclaim``). Image requests neither keep nor take."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    trim_prompt_cache,
)

from ...blocks.tokens import common_prefix
from ...hashing import BlockHash
from ...meta import Namespace
from .. import mlx_compat
from . import adapters

logger = logging.getLogger(__name__)

# room for this share more tokens, written in place by the next turn (past it ``grow`` copies once)
ROOM_SHARE = 8


@dataclass
class LiveState:
    """One kept state: the caches hold the state after ``tokens`` (uint32)."""

    root: BlockHash  # the namespace root: tenant, model, format
    tenant: str
    tokens: np.ndarray
    caches: list[Any]
    nbytes: int
    trimmable: bool
    session: str | None = None
    narrays: int = 0  # MLX arrays it holds (Metal caps their number per process)
    kept_at: float = 0.0  # the cache's clock when kept (its TTL applies)


@dataclass
class LiveCounters:
    """What the live states did (engine stats, ``live_*``)."""

    kept: int = 0  # states kept at a request's end
    taken: int = 0  # requests that continued from a live state
    tokens: int = 0  # prompt tokens those requests took from it
    trimmed: int = 0  # of those requests, the ones that trimmed it (a branch, a retry)
    not_kept: int = 0  # states that could not be kept (no room, a layer not detachable)
    reclaimed: int = 0  # states released for the RAM tier's room or by ``clear``
    replaced: int = 0  # states dropped for the count limit
    expired: int = 0  # states older than the cache's TTL, dropped unused
    errors: int = 0  # failures keeping or taking one (the request went on without it)


def _round_up(n: int, step: int) -> int:
    return max(step, (n + step - 1) // step * step)


def _detach(caches: Sequence[Any], pos: int, private: bool) -> list[Any] | None:
    """Caches with own buffers holding exactly the state after ``pos``; None if impossible."""
    out: list[Any] = []
    for c in caches:
        if isinstance(c, CacheList):
            sub = _detach(list(c.caches), pos, private)
            if sub is None:
                return None
            out.append(CacheList(*sub))
            continue
        if type(c) is KVCache:
            if c.offset < pos or c.keys is None:
                return None
            if private:
                c.offset = pos  # its own buffers: trimming is moving the offset
                out.append(c)
                continue
            cap = _round_up(pos + max(KVCache.step, pos // ROOM_SHARE), KVCache.step)
            fresh = KVCache()
            fresh.keys = _padded(c.keys, pos, cap)
            fresh.values = _padded(c.values, pos, cap)
            fresh.offset = pos
            out.append(fresh)
            continue
        if isinstance(c, (QuantizedKVCache, RotatingKVCache)):
            if c.offset > pos:
                if not c.is_trimmable():
                    return None
                c.trim(c.offset - pos)
            if c.offset != pos:
                return None
            out.append(c)
            continue
        if isinstance(c, ArraysCache):
            out.append(c)  # the state at ``pos`` by the finish contract; copies or private
            continue
        return None
    return out


def _padded(a: mx.array, n: int, cap: int) -> mx.array:
    """The first ``n`` positions of ``a`` (axis 2) in a buffer of its own of ``cap`` positions."""
    head = a[..., :n, :]
    if cap == n:
        return mlx_compat.copy_array(head)
    room = mx.zeros((*a.shape[:2], cap - n, a.shape[3]), dtype=a.dtype)
    return mx.concatenate([head, room], axis=2)


def grow(caches: Sequence[Any], total: int) -> None:
    """Room for ``total`` positions in every plain KV layer (the prefill then writes in place)."""
    for c in _leaves(caches):
        if type(c) is not KVCache or c.keys is None or c.keys.shape[2] >= total:
            continue
        cap = _round_up(total, KVCache.step)
        c.keys = _padded(c.keys, c.offset, cap)
        c.values = _padded(c.values, c.offset, cap)


def keep_position(caches: Sequence[Any], pos: int, valid: int) -> int:
    """Where to keep a finished state: ``pos``, or up to ``valid`` if a full window has it."""
    leaves = _leaves(caches)
    if any(isinstance(c, ArraysCache) for c in leaves):
        return pos
    for c in leaves:
        if isinstance(c, RotatingKVCache) and pos < c.offset <= valid \
                and not c.is_trimmable():
            return int(c.offset)
    return pos


def _leaves(caches: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for c in caches:
        out.extend(_leaves(list(c.caches)) if isinstance(c, CacheList) else [c])
    return out


class LiveStates:
    """The kept live states of one engine (thread-safe; reclaim runs under the cache lock)."""

    def __init__(self, max_states: int, hold: Callable[[int], bool],
                 drop: Callable[[int], None], *, clock: Callable[[], float] = lambda: 0.0,
                 ttl_s: float | None = None) -> None:
        if max_states < 0:
            raise ValueError(f"max_states must be >= 0, got {max_states}")
        self.max_states = max_states
        self._hold = hold
        self._drop = drop
        self._clock = clock
        self._ttl_s = ttl_s  # the cache's TTL: an older state is not used (and dropped)
        self._lock = threading.Lock()
        self._states: OrderedDict[int, LiveState] = OrderedDict()
        self._next = 0
        self.counters = LiveCounters()

    def __len__(self) -> int:
        with self._lock:
            return len(self._states)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._states.values())

    def stats(self) -> dict[str, int]:
        with self._lock:
            c = self.counters
            return {"live_states": len(self._states),
                    "live_bytes": sum(s.nbytes for s in self._states.values()),
                    "live_arrays": sum(s.narrays for s in self._states.values()),
                    **{f"live_{k}": int(v) for k, v in c.__dict__.items()}}

    def keep(self, ns: Namespace, tokens: np.ndarray, caches: Sequence[Any], *,
             private: bool, session: str | None = None) -> bool:
        """Keep the state after ``tokens`` (``private``: own objects); False if not kept."""
        if self.max_states == 0 or tokens.shape[0] == 0:
            return False
        try:
            own = _detach(caches, int(tokens.shape[0]), private)
            if own is None:
                self.counters.not_kept += 1
                return False
            arrays = [a for _, a in adapters.state_arrays(own)]
            mx.async_eval(*arrays)  # type: ignore[no-untyped-call]
            nbytes = sum(int(a.nbytes) for a in arrays)
            state = LiveState(ns.root, ns.tenant, np.array(tokens, dtype=np.uint32), own, nbytes,
                              bool(can_trim_prompt_cache(own)), session, len(arrays),
                              self._clock())
        except Exception:
            logger.exception("keeping a live state failed")
            self.counters.errors += 1
            return False
        if not self._hold(nbytes):  # counted in the RAM budget (may reclaim older ones)
            self.counters.not_kept += 1
            return False
        over: list[LiveState] = []
        with self._lock:
            self._states[self._next] = state
            self._next += 1
            while len(self._states) > self.max_states:
                over.append(self._states.popitem(last=False)[1])
            self.counters.kept += 1
            self.counters.replaced += len(over)
        for s in over:
            self._drop(s.nbytes)
        return True

    def take(self, ns: Namespace, prompt: np.ndarray, blocks: int,
             session: str | None = None) -> tuple[list[Any], int] | None:
        """Take the state of ``ns`` serving most of ``prompt``, trimmed, if worth more than the
        ``blocks``; else None."""
        limit = int(prompt.shape[0]) - 1
        best: tuple[int, int] | None = None  # (tokens served, key)
        expired = 0
        with self._lock:
            if self._ttl_s is not None:
                now = self._clock()
                for key in [k for k, s in self._states.items()
                            if now - s.kept_at > self._ttl_s]:
                    expired += self._states.pop(key).nbytes
                    self.counters.expired += 1
            for key, s in self._states.items():
                if s.root != ns.root:
                    continue
                held = int(s.tokens.shape[0])
                n = min(common_prefix(s.tokens, prompt), limit)
                if n <= 0 or (n < held and not s.trimmable):
                    continue  # an array state or a full window: only an exact extension
                if n < blocks or (n < held and 2 * n < held
                                  and (session is None or s.session != session)):
                    continue  # it would lose most of itself: its own session's only
                if best is None or n > best[0]:
                    best = (n, key)
            state = self._states.pop(best[1]) if best is not None else None
        if expired:
            self._drop(expired)
        if state is None or best is None:
            return None
        n = best[0]
        self._drop(state.nbytes)
        held = int(state.tokens.shape[0])
        if n < held:
            trim_prompt_cache(state.caches, held - n)
            self.counters.trimmed += 1
        self.counters.taken += 1
        self.counters.tokens += n
        return state.caches, n

    def reclaim(self, nbytes: int) -> int:
        """The RAM tier's hook: release least recently kept states until ``nbytes`` are freed."""
        freed = 0
        with self._lock:
            while self._states and freed < nbytes:
                freed += self._states.popitem(last=False)[1].nbytes
                self.counters.reclaimed += 1
        return freed

    def release(self, nbytes: float) -> int:
        """``reclaim`` for the memory governor (not under the cache lock)."""
        freed = self.reclaim(int(min(nbytes, 1 << 62)))
        if freed:
            self._drop(freed)
        return freed

    def forget(self, tenant: str | None, session: str | None) -> int:
        """The cache's hook on deleting a tenant's or session's blocks: release their states."""
        freed = 0
        with self._lock:
            for key in [k for k, s in self._states.items()
                        if (tenant is None or s.tenant == tenant)
                        and (session is None or s.session == session)]:
                freed += self._states.pop(key).nbytes
                self.counters.reclaimed += 1
        return freed

    def clear(self) -> int:
        """Release every state (memory pressure, close); returns the bytes released."""
        with self._lock:
            states = list(self._states.values())
            self._states.clear()
            self.counters.reclaimed += len(states)
        freed = sum(s.nbytes for s in states)
        if freed:
            self._drop(freed)
        return freed
