"""Protection and session levels: cache breakpoints, ``prompt_cache_key``, active sessions.

``protect`` keeps a chain's RAM blocks from eviction for a ttl (within
``protect_share`` of the RAM budget, persisted at once); ``mark_active`` makes a chain
the latest of a session (evicted only after idle blocks). The bookkeeping is
``cache_levels.Levels``; this module finds the chain's RAM blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..blocks.pool import Block
from ..blocks.tokens import RequestTokens, to_request_tokens
from ..hashing import BlockHash
from ..meta import ExtraKeySpan, Namespace, extra_keys_for
from . import matcher as _matcher
from .base import CacheBase
from .types import check_ns, check_spans


class CacheProtect(CacheBase):
    """Cache breakpoints and ``prompt_cache_key`` chains (``protect``), active sessions
    (``mark_active``)."""

    # ---- levels: protection (cache breakpoints, prompt_cache_key), active sessions --
    def protect(self, tokens: Any, ns: Namespace, num_tokens: int, ttl_s: float, *,
                key: str | None = None, persist: bool = True, pin_s: float | None = None,
                extra_keys: Sequence[ExtraKeySpan] = ()) -> int:
        """Keep the RAM blocks holding ``tokens[:num_tokens]`` from eviction for
        ``ttl_s`` seconds (``cache_levels``): a cache breakpoint (``key`` None: renewed
        when the same prefix is protected again, whatever follows it; the block that
        holds the breakpoint is protected too, as a truncatable state restores inside
        it) or the latest chain of ``key`` (it
        replaces the key's previous chain). With ``persist`` the blocks are put into
        the lower tiers at once. Protected blocks take at most ``protect_share`` of
        the RAM budget (oldest protections give way). With ``pin_s`` (OpenAI
        ``prompt_cache_retention: 24h``) the whole chain is also pinned in every lower
        tier that can pin (``pin(hashes, seconds)``: the SSD tier) for ``pin_s``
        seconds, outside the cache lock; a pin only ever grows. Returns the blocks
        protected."""
        req = to_request_tokens(tokens)
        check_ns(ns, self.config.block_size)
        spans = check_spans(extra_keys)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative integer, got {num_tokens!r}")
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not ttl_s > 0:
            raise ValueError(f"ttl_s must be a positive number, got {ttl_s!r}")
        if key is not None and (not isinstance(key, str) or not key):
            raise ValueError(f"key must be a non-empty string or None, got {key!r}")
        if pin_s is not None and (isinstance(pin_s, bool) or not isinstance(pin_s, (int, float))
                                  or not pin_s > 0):
            raise ValueError(f"pin_s must be a positive number or None, got {pin_s!r}")
        end = min(num_tokens, req.n)
        full = self._full_hashes(req, ns, spans, end)
        with self._lock:
            self._now = self._clock()
            self.levels.tick(self._now)
            chain = self._ram_chain(req, ns, spans, end, full)
            if not chain:
                return 0
            if key is not None:
                claim: tuple[Any, ...] = ("key", ns.tenant, ns.key, key)
            else:  # the prefix itself: its last whole block and the tokens after it
                whole = min(end // ns.block_size, len(chain))
                anchor = chain[whole - 1] if whole else ns.root
                claim = ("breakpoint", ns.tenant, ns.key, anchor,
                         req.slice_bytes(whole * ns.block_size, end))
            n = self.levels.protect(claim, chain, float(ttl_s), self._now, persist=persist)
        if pin_s is not None:
            self._pin_lower(chain, float(pin_s))
        return n

    def _pin_lower(self, chain: list[BlockHash], pin_s: float) -> None:
        """Pin ``chain`` in the lower tiers that can pin (no cache lock held: the SSD
        tier commits to its index). A failing tier is counted, never raised."""
        for tier in self.lower:
            pin = getattr(tier, "pin", None)
            if pin is None:
                continue
            try:
                pin(chain, pin_s)
            except Exception as e:
                with self._lock:
                    self._on_tier_error(tier, e)

    def mark_active(self, tokens: Any, ns: Namespace, session: str, *,
                    extra_keys: Sequence[ExtraKeySpan] = ()) -> int:
        """The RAM chain holding ``tokens`` is the latest chain of ``session`` (any
        key the caller chooses: the server uses tenant, session and agent): evicted
        only after idle blocks until the session is quiet for ``active_session_s``.
        Returns the number of blocks in the chain."""
        req = to_request_tokens(tokens)
        check_ns(ns, self.config.block_size)
        spans = check_spans(extra_keys)
        if not isinstance(session, str) or not session:
            raise ValueError(f"session must be a non-empty string, got {session!r}")
        full = self._full_hashes(req, ns, spans, req.n)
        with self._lock:
            self._now = self._clock()
            self.levels.tick(self._now)
            chain = self._ram_chain(req, ns, spans, req.n, full)
            return self.levels.mark_active(("session", ns.tenant, ns.key, session), chain,
                                           self._now)

    def levels_snapshot(self) -> dict[str, Any]:
        """Protection and session-level gauges and counters (``cache_levels``)."""
        with self._lock:
            self._now = self._clock()
            self.levels.tick(self._now)
            return self.levels.snapshot()

    @staticmethod
    def _full_hashes(req: RequestTokens, ns: Namespace, spans: tuple[ExtraKeySpan, ...],
                     end: int) -> list[BlockHash]:
        """The chained hashes of the whole blocks of ``req`` that start before ``end``
        (no lock needed: pure hashing, done before the cache lock is taken)."""
        bs, parent, out = ns.block_size, ns.root, []
        for start in range(0, min(end, req.n - req.n % bs), bs):
            extra = extra_keys_for(spans, start, start + bs) if spans else ()
            parent = _matcher.block_hash(parent, req.arr[start:start + bs], extra)
            out.append(parent)
        return out

    def _ram_chain(self, req: RequestTokens, ns: Namespace, spans: tuple[ExtraKeySpan, ...],
                   end: int, full: list[BlockHash]) -> list[BlockHash]:
        """The hashes of the RAM blocks that hold ``req`` up to ``end`` (blocks starting
        before ``end``), head first; stops at the first position RAM does not hold.
        ``full``: ``_full_hashes``. Where no whole block matches, the stored child
        holding the most of the request's tokens there (a partial tail, or a longer
        truncatable block)."""
        bs, parent, out = ns.block_size, ns.root, []
        for i, start in enumerate(range(0, end, bs)):
            stop = min(start + bs, req.n)
            if i < len(full):
                h = full[i]
                block = self.pool.get(h)
                if block is not None and block.ns == ns and block.start == start \
                        and block.tokens == req.slice_bytes(start, stop):
                    out.append(h)
                    parent = h
                    continue
            want = req.slice_bytes(start, min(stop, end))
            best: Block | None = None
            for sib in self.pool.children(parent):
                if sib.ns != ns or sib.start != start or sib.block_hash is None:
                    continue
                if not (sib.tokens.startswith(want)
                        or req.slice_bytes(start, start + sib.num_tokens) == sib.tokens):
                    continue
                if best is None or sib.num_tokens > best.num_tokens:
                    best = sib
            if best is not None and best.block_hash is not None:
                out.append(best.block_hash)
            break
        return out
