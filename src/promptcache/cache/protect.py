"""Protection and session levels (``PromptCache.protect`` / ``mark_active``): finds a
chain's RAM blocks for ``levels.Levels`` and pins it in the lower tiers that can pin."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..blocks.pool import Block, BlockPool
from ..blocks.tokens import RequestTokens
from ..hashing import BlockHash
from ..meta import ExtraKeySpan, Namespace, extra_keys_for
from ..tiers.base import Tier
from . import matcher as _matcher
from .levels import Levels


def check_protect(num_tokens: int, ttl_s: float, key: str | None, pin_s: float | None) -> None:
    """``protect``'s arguments checked (ValueError)."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be a non-negative integer, got {num_tokens!r}")
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not ttl_s > 0:
        raise ValueError(f"ttl_s must be a positive number, got {ttl_s!r}")
    if key is not None and (not isinstance(key, str) or not key):
        raise ValueError(f"key must be a non-empty string or None, got {key!r}")
    if pin_s is not None and (isinstance(pin_s, bool) or not isinstance(pin_s, (int, float))
                              or not pin_s > 0):
        raise ValueError(f"pin_s must be a positive number or None, got {pin_s!r}")


def full_hashes(req: RequestTokens, ns: Namespace, spans: tuple[ExtraKeySpan, ...],
                 end: int) -> list[BlockHash]:
    """The chained hashes of the whole blocks of ``req`` that start before ``end``
    (no lock needed: pure hashing, done before the cache lock is taken)."""
    bs, parent, out = ns.block_size, ns.root, []
    for start in range(0, min(end, req.n - req.n % bs), bs):
        extra = extra_keys_for(spans, start, start + bs) if spans else ()
        parent = _matcher.block_hash(parent, req.arr[start:start + bs], extra)
        out.append(parent)
    return out


@dataclass(eq=False)
class Protect:
    pool: BlockPool
    lower: Sequence[Tier]
    levels: Levels

    def protect(self, req: RequestTokens, ns: Namespace, spans: tuple[ExtraKeySpan, ...],
                end: int, full: list[BlockHash], ttl_s: float, key: str | None,
                persist: bool, now: float) -> tuple[int, list[BlockHash]]:
        """(blocks protected, the chain)."""
        chain = self._ram_chain(req, ns, spans, end, full)
        if not chain:
            return 0, chain
        if key is not None:
            claim: tuple[Any, ...] = ("key", ns.tenant, ns.key, key)
        else:  # the prefix itself: its last whole block and the tokens after it
            whole = min(end // ns.block_size, len(chain))
            anchor = chain[whole - 1] if whole else ns.root
            claim = ("breakpoint", ns.tenant, ns.key, anchor,
                     req.slice_bytes(whole * ns.block_size, end))
        return self.levels.protect(claim, chain, ttl_s, now, persist=persist), chain

    def mark_active(self, req: RequestTokens, ns: Namespace, spans: tuple[ExtraKeySpan, ...],
                    full: list[BlockHash], session: str, now: float) -> int:
        chain = self._ram_chain(req, ns, spans, req.n, full)
        return self.levels.mark_active(("session", ns.tenant, ns.key, session), chain, now)

    def pin(self, chain: list[BlockHash], pin_s: float) -> list[tuple[Tier, Exception]]:
        """Pin ``chain`` in the lower tiers that can pin (call it without the cache lock:
        the SSD tier commits to its index); returns the tiers that failed, with why."""
        failed: list[tuple[Tier, Exception]] = []
        for tier in self.lower:
            pin = getattr(tier, "pin", None)
            if pin is None:
                continue
            try:
                pin(chain, pin_s)
            except Exception as e:
                failed.append((tier, e))
        return failed

    def _ram_chain(self, req: RequestTokens, ns: Namespace, spans: tuple[ExtraKeySpan, ...],
                   end: int, full: list[BlockHash]) -> list[BlockHash]:
        """Hashes of the RAM blocks holding ``req`` up to ``end``, head first, stopping
        where RAM holds nothing; past the whole blocks, the child holding the most of
        the request there. ``full``: ``full_hashes``."""
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
