"""Draft tokens from history (prompt lookup / suffix matching): a request's own sequence
(``SequenceDrafts``: an n-gram index, a copy cursor that re-syncs after a change, copies
that run on over a loop) first, then its tenant's pool (``TenantDrafts``; ``DraftPools``
keeps tenants apart). Pure Python over token ids; a draft only costs a wider forward."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DraftConfig:
    min_n: int = 2  # shortest tail that may propose
    max_n: int = 8  # longest tail looked up
    max_k: int = 16  # most tokens proposed at once
    pool_tokens: int = 1_000_000  # tokens a tenant's pool keeps
    cursor_window: int = 64  # tokens after the copy cursor searched for the tail (0: off)
    cursor_min_n: int = 1  # the shortest tail that re-syncs at the cursor

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")
        if self.max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {self.max_k}")
        if self.pool_tokens < 0:
            raise ValueError(f"pool_tokens must be >= 0, got {self.pool_tokens}")
        if self.cursor_window < 0 or not 1 <= self.cursor_min_n <= self.max_n:
            raise ValueError(f"need cursor_window >= 0 and 1 <= cursor_min_n <= max_n, got "
                             f"{self.cursor_window}, {self.cursor_min_n}")


@dataclass(frozen=True)
class Draft:
    tokens: tuple[int, ...]
    matched: int  # length of the n-gram that proposed it (0: no draft)
    source: str  # "self" | "pool" | ""
    at: int = -1  # where in the sequence the draft starts ("self"; -1: elsewhere)


NO_DRAFT = Draft((), 0, "")


class SequenceDrafts:
    """One growing sequence and its n-gram index (see the module docstring)."""

    def __init__(self, tokens: Iterable[int] = (), config: DraftConfig | None = None) -> None:
        self.config = config or DraftConfig()
        self.tokens: list[int] = []
        # n-gram -> the position right after its latest occurrence
        self._after: dict[tuple[int, ...], int] = {}
        # where the last verified draft stopped being accepted (None: no copy yet)
        self.cursor: int | None = None
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        """Add one token; the n-grams ending before it are indexed now (an n-gram is
        indexed once a token follows it, so a lookup never proposes nothing)."""
        toks = self.tokens
        end = len(toks)
        cfg = self.config
        for n in range(cfg.min_n, cfg.max_n + 1):
            if n > end:
                break
            self._after[tuple(toks[end - n:end])] = end
        toks.append(int(token))

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(t)

    def propose(self, k: int) -> Draft:
        """Up to ``k`` tokens: after the tail's re-sync point near the copy cursor
        (``resync``), else after the latest earlier occurrence of the longest tail
        n-gram (``NO_DRAFT`` when no tail of ``min_n`` or more occurred before)."""
        k = min(k, self.config.max_k)
        near = self.resync(k)
        if near.tokens:
            return near
        return lookup(self._after, self.tokens, self.tokens, k, self.config, "self")

    def resync(self, k: int) -> Draft:
        """The tokens after the first position in ``cursor_window`` tokens from the
        cursor whose preceding tokens match the longest tail (at least
        ``cursor_min_n``), ``NO_DRAFT`` when none does."""
        cfg, toks, cur = self.config, self.tokens, self.cursor
        end = len(toks)
        if cur is None or k <= 0 or cfg.cursor_window == 0 or end == 0:
            return NO_DRAFT
        best, best_n = -1, cfg.cursor_min_n - 1
        last = toks[-1]
        for j in range(max(1, cur), min(end - 1, cur + cfg.cursor_window)):
            if toks[j - 1] != last:
                continue
            n = 1
            while n < cfg.max_n and n < j and toks[j - 1 - n] == toks[end - 1 - n]:
                n += 1
            if n > best_n:
                best, best_n = j, n
                if n == cfg.max_n:
                    break
        if best < 0:
            return NO_DRAFT
        return Draft(copy(toks, best, k), best_n, "self", best)


def copy(toks: Sequence[int], at: int, k: int) -> tuple[int, ...]:
    """``k`` tokens of a sequence from ``at``; past its end the copy goes on over what it
    copied (an overlapping copy: the tail that matched at ``at`` repeats with period
    ``len(toks) - at``), so a reply caught in a loop drafts ``k`` tokens, not the few
    left before its end."""
    out = list(toks[at:at + k])
    period = len(toks) - at
    while 0 < period and len(out) < k:
        out.append(out[len(out) - period])
    return tuple(out)


def lookup(index: dict[tuple[int, ...], int], source: Sequence[int], tail_of: Sequence[int],
           k: int, config: DraftConfig, name: str) -> Draft:
    """The draft for the tail of ``tail_of`` from ``index`` over ``source``."""
    if k <= 0:
        return NO_DRAFT
    end = len(tail_of)
    for n in range(min(config.max_n, end), config.min_n - 1, -1):
        at = index.get(tuple(tail_of[end - n:end]))
        if at is None:
            continue
        out = copy(source, at, k) if source is tail_of else tuple(source[at:at + k])
        if out:
            return Draft(out, n, name, at if name == "self" else -1)
    return NO_DRAFT


class TenantDrafts:
    """A bounded pool of one tenant's recent sequences (thread-safe)."""

    def __init__(self, config: DraftConfig | None = None) -> None:
        self.config = config or DraftConfig()
        self._tokens: list[int] = []  # every kept sequence, one after the other
        # absolute (start, end) of each kept sequence, oldest first
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}
        self._offset = 0  # absolute position of self._tokens[0]
        self._lock = threading.Lock()

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    @property
    def num_ngrams(self) -> int:
        """Entries of the n-gram index (with the tokens, what the pool's memory is)."""
        return len(self._after)

    def add(self, tokens: Sequence[int]) -> None:
        """Remember a sequence (a finished prompt + output); the oldest go past the
        budget. n-grams never span two sequences."""
        cfg = self.config
        if not tokens or cfg.pool_tokens == 0:
            return
        toks = [int(t) for t in tokens[-cfg.pool_tokens:]]
        with self._lock:
            start = self._offset + len(self._tokens)
            self._tokens.extend(toks)
            for i in range(len(toks)):
                for n in range(cfg.min_n, cfg.max_n + 1):
                    if n > i:
                        break
                    self._after[tuple(toks[i - n:i])] = start + i
            self._starts.append(start)
            self._ends.append(start + len(toks))
            self._evict()

    def _evict(self) -> None:
        cfg = self.config
        drop = 0
        while len(self._tokens) - (self._ends[drop - 1] - self._offset if drop else 0) \
                > cfg.pool_tokens and drop < len(self._starts):
            drop += 1
        if drop:
            end = self._ends[drop - 1]
            # the index entries into the dropped sequences go with them (an n-gram seen
            # again later points there and stays): the index holds the kept tokens'
            # n-grams only, so its memory follows the pool's instead of growing stale
            # entries and being rebuilt in steps
            after = self._after
            for first, last in zip(self._starts[:drop], self._ends[:drop], strict=True):
                toks = self._tokens[first - self._offset:last - self._offset]
                for i in range(len(toks)):
                    for n in range(cfg.min_n, cfg.max_n + 1):
                        if n > i:
                            break
                        gram = tuple(toks[i - n:i])
                        if after.get(gram) == first + i:
                            del after[gram]
            del self._tokens[:end - self._offset]
            del self._starts[:drop], self._ends[:drop]
            self._offset = end

    def propose(self, tail: Sequence[int], k: int) -> Draft:
        cfg = self.config
        k = min(k, cfg.max_k)
        if k <= 0:
            return NO_DRAFT
        with self._lock:
            end = len(tail)
            for n in range(min(cfg.max_n, end), cfg.min_n - 1, -1):
                at = self._after.get(tuple(tail[end - n:end]))
                if at is None or at < self._offset:
                    continue
                span_end = self._span_end(at)
                rel = at - self._offset
                out = tuple(self._tokens[rel:min(rel + k, span_end - self._offset)])
                if out:
                    return Draft(out, n, "pool")
        return NO_DRAFT

    def _span_end(self, at: int) -> int:
        """The end of the kept sequence holding absolute position ``at``."""
        i = bisect.bisect_right(self._starts, at) - 1
        return self._ends[i] if i >= 0 and at < self._ends[i] else at


class DraftPools:
    """One ``TenantDrafts`` per tenant: a request only ever reads its own tenant's.
    ``config.pool_tokens`` bounds each pool and, through ``add``, all of them together
    (the pools added to least recently are dropped first)."""

    def __init__(self, config: DraftConfig | None = None) -> None:
        self.config = config or DraftConfig()
        self._pools: dict[str, TenantDrafts] = {}  # least recently added to first
        self._lock = threading.Lock()

    def add(self, tenant: str, tokens: Sequence[int]) -> None:
        """Remember ``tokens`` in ``tenant``'s pool; other tenants' pools, least recently
        added to first, are dropped while all pools hold more than ``pool_tokens``."""
        if not tokens or self.config.pool_tokens == 0:
            return
        pool = self.pool(tenant)
        pool.add(tokens)
        with self._lock:
            self._pools[tenant] = self._pools.pop(tenant, pool)
            total = sum(p.num_tokens for p in self._pools.values())
            for name in list(self._pools):
                if total <= self.config.pool_tokens or name == tenant:
                    break
                total -= self._pools.pop(name).num_tokens

    def get(self, tenant: str) -> TenantDrafts | None:
        """``tenant``'s pool, None when it has none (nothing is created)."""
        with self._lock:
            return self._pools.get(tenant)

    def pool(self, tenant: str) -> TenantDrafts:
        with self._lock:
            p = self._pools.get(tenant)
            if p is None:
                p = self._pools[tenant] = TenantDrafts(self.config)
            return p

    def num_tokens(self) -> int:
        with self._lock:
            return sum(p.num_tokens for p in self._pools.values())

    def num_ngrams(self) -> int:
        with self._lock:
            return sum(p.num_ngrams for p in self._pools.values())


def propose(own: SequenceDrafts, pool: TenantDrafts | None, k: int) -> Draft:
    """The request's own history first, then its tenant's pool."""
    draft = own.propose(k)
    if draft.tokens or pool is None:
        return draft
    return pool.propose(own.tokens, k)
