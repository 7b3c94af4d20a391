"""Live session state: the caches of a finished turn kept as the model's own cache
objects, so that the next request extending them (the usual agent or chat turn)
restores nothing from blocks: it trims them to the common prefix and prefills only
what is new.

A request that finishes (a reply, a cancelled stream, a prefill-only pre-render)
hands its caches to ``LiveStates.keep``: plain KV is copied out of the decode batch
into its own buffers (one copy per layer, with room for an eighth more tokens: the next
turn writes its new tokens in place), private caches are kept as they are. A
new request's ``take`` finds the state of its namespace (tenant, model, cache
format) with the longest common prefix; the caller uses it instead of the blocks
when it reaches at least as far as the blocks would (``request_saves``; ``take`` says
when a state that would be trimmed to less than half of itself is left alone). A state is
taken whole (the request writes into it), so two requests never share one: requests
of one session that overlap take it once, the other restores from blocks. A branch
(or a retry) trims a state whose every layer can be trimmed (plain, MLA, quantized
KV, windows not yet full); array (SSM) states and full windows are used only when
the new prompt extends them exactly, otherwise the blocks serve. Another server has
no live state: the blocks (SSD, Redis) serve it, as they do every other path; the
blocks stay the source of truth, the live state is only a faster copy.

Bytes: each state is counted in the RAM tier's budget (``PromptCache.hold_outside``)
and released after the idle blocks and before the active ones when the tier needs
room (``reclaim``, the pool's hook), or when a memory governor asks (``clear``); a
deleted tenant's or session's states go with its blocks (``forget``). At
most ``max_states`` states are kept (least recently kept dropped first).

Requests with image embeddings (their extra keys are not in the token ids) neither
keep nor take a live state.
"""

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

from ..blocks.tokens import common_prefix
from ..hashing import BlockHash
from ..meta import Namespace
from . import adapters, mlx_compat

logger = logging.getLogger(__name__)

# a kept plain-KV state has room for this share of its tokens more (its next turn's new
# tokens are written in place up to there; past it, ``grow`` copies it once)
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
    """Caches holding exactly the state after ``pos`` tokens, with buffers of their own
    (``caches`` may be views of a decode-batch row: plain KV is copied then); None when
    a layer cannot be brought to ``pos``."""
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
            # room for the next turn's new tokens (an eighth of the state, at least one
            # growth step), so the turn that takes it writes in place: no copy then
            cap = _round_up(pos + max(KVCache.step, pos // ROOM_SHARE), KVCache.step)
            fresh = KVCache()
            fresh.keys = _padded(c.keys, pos, cap)
            fresh.values = _padded(c.values, pos, cap)
            fresh.offset = pos
            out.append(fresh)
            continue
        if isinstance(c, (QuantizedKVCache, RotatingKVCache)):
            # private objects (decoding alone) or copies (a window extracted from a row)
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
    """The first ``n`` positions of ``a`` (axis 2) in a buffer of its own holding
    ``cap`` positions."""
    head = a[..., :n, :]
    if cap == n:
        return mlx_compat.copy_array(head)
    room = mx.zeros((*a.shape[:2], cap - n, a.shape[3]), dtype=a.dtype)
    return mx.concatenate([head, room], axis=2)


def grow(caches: Sequence[Any], total: int) -> None:
    """Room for ``total`` positions in every plain KV layer (one copy of a layer whose
    buffer is smaller, rounded up to mlx-lm's growth step), so that the prefill that
    follows writes in place instead of copying the whole KV at every chunk."""
    for c in _leaves(caches):
        if type(c) is not KVCache or c.keys is None or c.keys.shape[2] >= total:
            continue
        cap = _round_up(total, KVCache.step)
        c.keys = _padded(c.keys, c.offset, cap)
        c.values = _padded(c.values, c.offset, cap)


def keep_position(caches: Sequence[Any], pos: int, valid: int) -> int:
    """Where to keep a finished request's state: ``pos`` (prompt + output[:-1], as the
    end-of-generation save), or past it, up to ``valid`` tokens, when a full sliding
    window already holds the last output token (fed by the step in flight: a window
    cannot give a token back) and no array state was taken from before that step."""
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
    """The kept live states of one engine (thread-safe: the engine thread keeps and
    takes, the RAM tier's hook may reclaim from any thread holding the cache lock)."""

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

    # ---- queries ----------------------------------------------------------------
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

    # ---- keep / take ------------------------------------------------------------
    def keep(self, ns: Namespace, tokens: np.ndarray, caches: Sequence[Any], *,
             private: bool, session: str | None = None) -> bool:
        """Keep the state after ``tokens`` (``caches``: views of a batch row, or the
        request's own objects when ``private``). False when it is not kept."""
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
        """The live state of ``ns`` that serves the most of ``prompt`` (at most all but
        its last token, which runs again for its logits), trimmed to that, when it
        serves at least the ``blocks`` tokens the blocks would restore and either
        extends exactly, or keeps at least half of itself (a retry, an edit of the last
        message), or is the same session's. Another conversation that shares only a
        system prompt (or a first token) does not take it: its state stays for its own
        next turn, and the blocks serve the shared prefix. None when none serves. The
        state leaves the store."""
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

    # ---- releasing ----------------------------------------------------------------
    def reclaim(self, nbytes: int) -> int:
        """The RAM tier's hook: release the least recently kept states until at least
        ``nbytes`` are freed (or none is left); returns the bytes released. Does not
        call back into the cache."""
        freed = 0
        with self._lock:
            while self._states and freed < nbytes:
                freed += self._states.popitem(last=False)[1].nbytes
                self.counters.reclaimed += 1
        return freed

    def release(self, nbytes: float) -> int:
        """Release the least recently kept states until at least ``nbytes`` are freed
        (the memory governor, not under the cache lock); returns the bytes released."""
        freed = self.reclaim(int(min(nbytes, 1 << 62)))
        if freed:
            self._drop(freed)
        return freed

    def forget(self, tenant: str | None, session: str | None) -> int:
        """The cache's hook when a tenant's blocks (None: everyone's) or one session of
        theirs are deleted: release the matching states (a state of an unnamed session
        goes with its tenant only); returns the bytes released. Does not call back into
        the cache."""
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
