"""The children of a matched block, in RAM and the lower tiers: the matcher's last
step (a partial or diverging block after the walked chain, a snapshot inside it), the
cached side of a divergence (``stored_after``) and why a match stopped (``explain``).
Never changes the pool."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..blocks.pool import Block, BlockPool
from ..blocks.tokens import RequestTokens
from ..hashing import BlockHash
from ..meta import ExtraKeySpan, Namespace, extra_keys_for
from .entries import Entry, LowerEntry, MetaSource, entry_meta
from .miss import COLD, DIVERGED, EXPIRED, NOT_RESTORABLE, CacheMiss, GoneMemory, Reason

# lower tiers are asked for the siblings of at most this many walked blocks (RAM: all)
INNER_LOWER_BLOCKS = 16

# a child: (entry, its packed tokens, extra keys, truncatable, restorable at its end)
Child = tuple[Entry, bytes, tuple[bytes, ...], bool, bool]


def lcp_tokens(a: bytes, b: bytes) -> int:
    """Common prefix length, in tokens, of two packed token strings."""
    n = min(len(a), len(b)) >> 2
    if a[: n * 4] == b[: n * 4]:
        return n
    x = np.frombuffer(a, dtype="<u4", count=n)
    y = np.frombuffer(b, dtype="<u4", count=n)
    return int(np.argmax(x != y))


@dataclass(eq=False)
class Branches:
    """The stored children of a block (RAM first, then each lower tier's ``children``)."""

    pool: BlockPool
    lower: Sequence[MetaSource]
    gone: GoneMemory
    expired: Callable[[Block, float], bool]
    on_tier_error: Callable[[MetaSource, Exception], None]

    def children(self, parent: BlockHash, pos: int, ns: Namespace, now: float, *,
                 lower: bool = True) -> list[Child]:
        out: list[Child] = []
        seen: set[bytes] = set()
        for block in self.pool.children(parent):
            if (block.start != pos or not (block.ns is ns or block.ns == ns)
                    or self.expired(block, now)):
                continue
            if block.block_hash is not None:
                seen.add(block.block_hash)
            out.append((block, block.tokens, block.extra_keys, block.truncatable,
                        block.restorable_at_end()))
        ns_key = ns.key
        for src in self.lower if lower else ():
            try:
                metas = src.children(parent, ns=ns)
            except Exception as e:  # a tier breaking its contract is a tier failure too
                self.on_tier_error(src, e)
                continue
            for meta in metas:
                if meta.block_hash in seen or meta.start != pos or meta.namespace_key != ns_key:
                    continue
                seen.add(meta.block_hash)
                out.append((LowerEntry(meta, src), np.asarray(meta.token_ids, dtype="<u4").tobytes(),
                            meta.extra_keys, meta.truncatable, meta.restorable_at_end()))
        return out

    def inner_snapshot(self, walked: list[Entry], best: int, cap: int, req: RequestTokens,
                       ns: Namespace, spans: Sequence[ExtraKeySpan], now: float
                       ) -> tuple[int, int, Entry] | None:
        """The furthest restorable ``(position, k, sibling)`` past ``best`` (at most ``cap``):
        a shorter sibling of walked block ``k`` the request starts with, restorable at its
        end; lower tiers are asked for the last ``INNER_LOWER_BLOCKS`` blocks only."""
        buf = req.buf
        for k in range(len(walked) - 1, -1, -1):
            start = walked[k].start
            if start + ns.block_size - 1 <= best:
                return None
            parent = entry_meta(walked[k]).parent_hash
            top: tuple[int, Entry] | None = None
            lower = len(walked) - k <= INNER_LOWER_BLOCKS
            for cand, c_tokens, c_extra, c_trunc, c_at_end in self.children(
                    parent, start, ns, now, lower=lower):
                c_len = len(c_tokens) >> 2
                reach = start + c_len
                if (c_len >= ns.block_size or not (c_trunc or c_at_end) or reach > cap
                        or reach <= best or (top is not None and reach <= top[0])):
                    continue
                if buf[start * 4:reach * 4] != c_tokens:
                    continue
                if c_extra != (extra_keys_for(spans, start, reach) if spans else ()):
                    continue
                top = (reach, cand)
            if top is not None:
                return top[0], k, top[1]
        return None

    def stored_after(self, req: RequestTokens, ns: Namespace, parent: BlockHash, start: int,
                     position: int, limit: int, now: float) -> list[int]:
        """Up to ``limit`` stored ids after ``req[:position]``, from ``parent``'s closest child."""
        bs = ns.block_size
        rest = req.buf[start * 4:]
        best: tuple[int, Entry, bytes] | None = None
        for cand, c_tokens, *_ in self.children(parent, start, ns, now):
            n = lcp_tokens(c_tokens, rest)
            if best is None or n > best[0]:
                best = (n, cand, c_tokens)
        if best is None:
            return []
        _, entry, c_tokens = best
        out = list(np.frombuffer(c_tokens, dtype="<u4")[position - start:].tolist())
        h = entry_meta(entry).block_hash
        while len(out) < limit and len(c_tokens) >> 2 == bs:
            start += bs
            kids = self.children(h, start, ns, now)
            if not kids:
                break
            entry, c_tokens = kids[0][0], kids[0][1]
            out.extend(np.frombuffer(c_tokens, dtype="<u4").tolist())
            h = entry_meta(entry).block_hash
        return [int(t) for t in out[:limit]]

    def explain(self, best: int, matched: int, n: int, next_hash: BlockHash | None,
                parent: BlockHash, diverged: bool, now: float) -> CacheMiss:
        """Why a match stopped at ``best``: the cause of its miss."""
        reason: Reason = (COLD, None)
        gone_next = self.gone.by_hash(next_hash) if next_hash is not None else None
        if min(matched, n - 1) > best:
            reason = (NOT_RESTORABLE, None)
        elif gone_next is not None:
            reason = gone_next
        elif next_hash is not None and self._expired_in_ram(next_hash, now):
            reason = (EXPIRED, None)
        elif diverged:
            reason = (DIVERGED, None)
        else:
            reason = self.gone.by_parent(parent) or (COLD, None)
        return CacheMiss(reason[0], position=matched, restorable=best, num_tokens=n,
                         store_error=reason[1])

    def _expired_in_ram(self, h: BlockHash, now: float) -> bool:
        block = self.pool.get(h)
        return block is not None and self.expired(block, now)
