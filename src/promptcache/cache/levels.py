"""Every RAM block's eviction level, under the cache lock: ``PROTECTED`` (a breakpoint or a
``prompt_cache_key``'s latest chain, within ``share`` of the budget, oldest giving way),
``ACTIVE`` (a session's latest chain within ``active_s``), else ``IDLE``; claims per hash."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from ..blocks.pool import ACTIVE, IDLE, PROTECTED, Block, BlockPool
from ..hashing import BlockHash

# a claim's key: ("breakpoint" | "key" | "session", tenant, namespace key, ...)
ClaimKey = tuple[Hashable, ...]
DEFAULT_PROTECT_SHARE = 0.25
DEFAULT_ACTIVE_S = 600.0


@dataclass
class _Claim:
    hashes: tuple[BlockHash, ...]
    until: float  # protection: expiry; session: last request + active_s


class Levels:
    def __init__(self, pool: BlockPool, *, share: float = DEFAULT_PROTECT_SHARE,
                 active_s: float | None = DEFAULT_ACTIVE_S,
                 persist: Callable[[list[Block]], None] | None = None) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"protect share must be in [0, 1], got {share!r}")
        if active_s is not None and active_s <= 0:
            raise ValueError(f"active_s must be > 0 or None, got {active_s!r}")
        self.pool = pool
        self.share = share
        self.active_s = active_s
        self._persist = persist
        # oldest (least recently renewed) first
        self._prot: OrderedDict[ClaimKey, _Claim] = OrderedDict()
        self._sessions: OrderedDict[ClaimKey, _Claim] = OrderedDict()
        self._pcount: dict[BlockHash, int] = {}
        self._acount: dict[BlockHash, int] = {}
        self._next = math.inf  # the earliest ``until`` of any claim
        self.given_way = 0  # protections dropped for a newer one (the share bound)
        self.trimmed = 0  # protections cut to the head that fits the share
        self.expired = 0  # protections that reached their ttl
        self.sessions_idle = 0  # sessions quiet for active_s

    @property
    def limit_bytes(self) -> int:
        return int(self.pool.budget_bytes * self.share)

    def level_of(self, h: BlockHash) -> int:
        if self._pcount.get(h):
            return PROTECTED
        if self._acount.get(h):
            return ACTIVE
        return IDLE

    def protected_bytes(self) -> int:
        """Bytes of the protected blocks in RAM (referenced or not)."""
        total = 0
        for h in self._pcount:
            block = self.pool.get(h)
            if block is not None:
                total += block.nbytes
        return total

    def protections(self) -> dict[ClaimKey, tuple[tuple[BlockHash, ...], float]]:
        """key -> (hashes, expiry), oldest first."""
        return {k: (c.hashes, c.until) for k, c in self._prot.items()}

    def active_sessions(self) -> dict[ClaimKey, tuple[tuple[BlockHash, ...], float]]:
        """key -> (hashes, idle from), least recently active first."""
        return {k: (c.hashes, c.until) for k, c in self._sessions.items()}

    def snapshot(self) -> dict[str, Any]:
        return {
            "protections": len(self._prot), "protected_blocks": len(self._pcount),
            "protected_bytes": self.protected_bytes(), "protect_limit_bytes": self.limit_bytes,
            "protections_given_way": self.given_way, "protections_trimmed": self.trimmed,
            "protections_expired": self.expired, "active_sessions": len(self._sessions),
            "active_blocks": len(self._acount), "sessions_idle": self.sessions_idle,
        }

    def protect(self, key: ClaimKey, hashes: Iterable[BlockHash], ttl_s: float, now: float,
                *, persist: bool = True) -> int:
        """Protect ``hashes`` under ``key`` till ``now + ttl_s``; returns the blocks protected."""
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        chain = tuple(hashes)
        touched: list[BlockHash] = list(chain)
        old = self._prot.pop(key, None)
        if old is not None:
            touched.extend(old.hashes)
            self._dec(self._pcount, old.hashes)
        if chain:
            self._prot[key] = _Claim(chain, now + ttl_s)
            self._inc(self._pcount, chain)
            self._next = min(self._next, now + ttl_s)
        touched.extend(self._enforce())
        self._apply(touched)
        claim = self._prot.get(key)
        if claim is None:
            return 0
        if persist and self._persist is not None:
            blocks = [b for b in map(self.pool.get, claim.hashes)
                      if b is not None and not b.persisted]
            if blocks:
                self._persist(blocks)
        return len(claim.hashes)

    def _enforce(self) -> list[BlockHash]:
        """Keep protected bytes within the share; returns the hashes that lost a protection."""
        touched: list[BlockHash] = []
        if not self._prot:
            return touched
        limit = self.limit_bytes
        have = self.protected_bytes()
        while have > limit and len(self._prot) > 1:
            _, oldest = self._prot.popitem(last=False)
            self.given_way += 1
            touched.extend(oldest.hashes)
            self._dec(self._pcount, oldest.hashes)
            have = self.protected_bytes()
        if have > limit:  # one protection left: every protected hash is its
            key, claim = next(iter(self._prot.items()))
            kept, total = 0, 0
            for h in claim.hashes:
                total += self._nbytes(h)
                if total > limit:
                    break
                kept += 1
            dropped = claim.hashes[kept:]
            self._dec(self._pcount, dropped)
            touched.extend(dropped)
            self.trimmed += 1
            if kept:
                claim.hashes = claim.hashes[:kept]
            else:
                del self._prot[key]
        return touched

    def supersede(self, old: BlockHash, new: Block) -> None:
        """A partial block gave way to a longer sibling: its claims move to the new block."""
        h = new.block_hash
        if h is None or (old not in self._pcount and old not in self._acount):
            return
        for claims, counts in ((self._prot, self._pcount), (self._sessions, self._acount)):
            for claim in claims.values():
                if old in claim.hashes and h not in claim.hashes:
                    claim.hashes = tuple(h if x == old else x for x in claim.hashes)
                    self._dec(counts, (old,))
                    self._inc(counts, (h,))
        self._apply([h, *self._enforce()])

    def resized(self, block: Block) -> None:
        """A protected block's payload changed size (a snapshot upgrade)."""
        if block.block_hash is not None and self._pcount.get(block.block_hash):
            self._apply(self._enforce())

    def mark_active(self, key: ClaimKey, hashes: Iterable[BlockHash], now: float) -> int:
        """``hashes`` is the latest chain of session ``key`` (a request just now)."""
        if self.active_s is None:
            return 0
        chain = tuple(hashes)
        touched: list[BlockHash] = list(chain)
        old = self._sessions.pop(key, None)
        if old is not None:
            touched.extend(old.hashes)
            self._dec(self._acount, old.hashes)
        self._sessions[key] = _Claim(chain, now + self.active_s)
        self._inc(self._acount, chain)
        self._next = min(self._next, now + self.active_s)
        self._apply(touched)
        return len(chain)

    def tick(self, now: float) -> None:
        """End the protections past their ttl and the sessions quiet for ``active_s``."""
        if now < self._next:
            return
        touched: list[BlockHash] = []
        for claims, counts, is_prot in ((self._prot, self._pcount, True),
                                        (self._sessions, self._acount, False)):
            for key in [k for k, c in claims.items() if c.until <= now]:
                claim = claims.pop(key)
                self._dec(counts, claim.hashes)
                touched.extend(claim.hashes)
                if is_prot:
                    self.expired += 1
                else:
                    self.sessions_idle += 1
        self._next = min((c.until for c in (*self._prot.values(), *self._sessions.values())),
                         default=math.inf)
        self._apply(touched)

    def on_new_block(self, block: Block) -> None:
        """A block entered RAM (stored or promoted): give it the level its hash has."""
        h = block.block_hash
        if h is not None and (h in self._pcount or h in self._acount):
            self.pool.set_level(block, self.level_of(h))

    def drop(self, which: Callable[[ClaimKey], bool]) -> int:
        """End every claim whose key ``which`` selects; returns how many."""
        touched: list[BlockHash] = []
        n = 0
        for claims, counts in ((self._prot, self._pcount), (self._sessions, self._acount)):
            for key in [k for k in claims if which(k)]:
                claim = claims.pop(key)
                self._dec(counts, claim.hashes)
                touched.extend(claim.hashes)
                n += 1
        self._apply(touched)
        return n

    def _nbytes(self, h: BlockHash) -> int:
        block = self.pool.get(h)
        return block.nbytes if block is not None else 0

    @staticmethod
    def _inc(counts: dict[BlockHash, int], hashes: Iterable[BlockHash]) -> None:
        for h in hashes:
            counts[h] = counts.get(h, 0) + 1

    @staticmethod
    def _dec(counts: dict[BlockHash, int], hashes: Iterable[BlockHash]) -> None:
        for h in hashes:
            n = counts.get(h, 0) - 1
            if n > 0:
                counts[h] = n
            else:
                counts.pop(h, None)

    def _apply(self, hashes: Iterable[BlockHash]) -> None:
        """Set the levels of the chains ``hashes`` (head first) so that a chain loses its
        tail first: lowered blocks enter at the evict-first end, raised ones at the end."""
        lowered: list[Block] = []
        raised: list[Block] = []
        for h in dict.fromkeys(hashes):
            block = self.pool.get(h)
            if block is None:
                continue
            level = self.level_of(h)
            if level < block.level:
                lowered.append(block)
            elif level > block.level:
                raised.append(block)
        for block in lowered:
            self.pool.set_level(block, self.level_of(block.block_hash))  # type: ignore[arg-type]
        for block in reversed(raised):
            self.pool.set_level(block, self.level_of(block.block_hash))  # type: ignore[arg-type]
