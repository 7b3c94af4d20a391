"""Token-granular prefix matching over RAM + lower tiers (a pure query): walk the request's
full blocks by chained hash (lower tiers asked once per window); a block counts only if its
tokens, parent and start equal the request's (collisions are harmless); then the longest
child (``branches``); the end is restorable and never past the last token."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..blocks.pool import Block, BlockPool
from ..blocks.tokens import RequestTokens
from ..hashing import BlockHash, hash_block
from ..meta import BlockMeta, ExtraKeySpan, Namespace, extra_keys_for
from .branches import Branches, lcp_tokens
from .entries import Entry, LowerEntry, MetaSource, RawMatch

# lower tiers are asked for this many blocks, then the rest only if all were found
LOWER_WINDOW = 256


def block_hash(parent: BlockHash, token_ids: Any, extra_keys: tuple[bytes, ...]) -> BlockHash:
    """The one place blocks are hashed (tests patch ``hash_block`` here)."""
    return hash_block(parent, token_ids, extra_keys)


@dataclass(eq=False)
class Matcher:
    pool: BlockPool
    lower: Sequence[MetaSource]
    branches: Branches
    expired: Callable[[Block, float], bool]
    on_tier_error: Callable[[MetaSource, Exception], None]

    def _ram_ok(self, block: Block, start: int, extra: tuple[bytes, ...], ns: Namespace,
                now: float) -> bool:
        return (
            block.block_hash is not None
            and block.start == start
            and block.extra_keys == extra
            and (block.ns is ns or block.ns == ns)
            and not self.expired(block, now)
        )

    @staticmethod
    def _meta_ok(meta: BlockMeta | None, parent: BlockHash, start: int, want: bytes,
                 ns_key: str, extra: tuple[bytes, ...]) -> bool:
        return (
            meta is not None
            and meta.parent_hash == parent
            and meta.start == start
            and meta.namespace_key == ns_key
            and meta.extra_keys == extra
            and np.asarray(meta.token_ids, dtype="<u4").tobytes() == want
        )

    def _lower_chain(self, req: RequestTokens, ns: Namespace, spans: Sequence[ExtraKeySpan],
                     pos: int, parent: BlockHash, h: BlockHash
                     ) -> tuple[dict[int, BlockHash], dict[int, LowerEntry]]:
        """Hashes of the full blocks from ``pos`` on (``h`` first) and their lower tier
        entries, as ``({start: hash}, {start: entry})``: one ``get_metas`` per tier for
        the first ``LOWER_WINDOW`` blocks, one more for the rest only if all were found."""
        bs, n, arr, buf = ns.block_size, req.n, req.arr, req.buf
        starts = list(range(pos, n - bs + 1, bs))
        hashes = [h]
        found: list[LowerEntry | None] = []
        ns_key = ns.key
        done, stop = 0, min(len(starts), LOWER_WINDOW)
        while done < stop:
            for s in starts[len(hashes):stop]:
                extra = extra_keys_for(spans, s, s + bs) if spans else ()
                hashes.append(block_hash(hashes[-1], arr[s:s + bs], extra))
            found.extend([None] * (stop - done))
            first = done
            for src in self.lower:
                if first >= stop:
                    break
                got: list[tuple[int, BlockMeta]] = []
                try:
                    metas = src.get_metas(hashes[first:stop], ns=ns)
                    if len(metas) != stop - first:
                        raise ValueError(f"get_metas returned {len(metas)} entries for "
                                        f"{stop - first} hashes")
                    for j, meta in enumerate(metas, first):
                        if found[j] is not None or meta is None:
                            continue
                        s = starts[j]
                        extra = extra_keys_for(spans, s, s + bs) if spans else ()
                        p = hashes[j - 1] if j else parent
                        if self._meta_ok(meta, p, s, buf[s * 4:(s + bs) * 4], ns_key, extra):
                            got.append((j, meta))
                except Exception as e:  # a tier breaking its contract is a tier failure too
                    self.on_tier_error(src, e)
                    continue
                for j, meta in got:
                    found[j] = LowerEntry(meta, src)
                while first < stop and found[first] is not None:
                    first += 1
            if first < stop:  # the leading run ends inside this window
                break
            done, stop = stop, len(starts)
        chain = dict(zip(starts, hashes, strict=False))
        return chain, {s: e for s, e in zip(starts, found, strict=False) if e is not None}

    def match(self, req: RequestTokens, ns: Namespace, spans: Sequence[ExtraKeySpan],
              now: float) -> RawMatch:
        n = req.n
        bs = ns.block_size
        cap = n - 1  # the last token is always recomputed
        arr, buf = req.arr, req.buf
        entries: list[Entry] = []
        parent = ns.root
        pos = 0
        best = 0  # furthest restorable position
        best_len = 0  # entries needed for `best`
        next_hash: BlockHash | None = None
        find_child = self.pool.find_child
        expired = self.expired
        prev: Block | None = None  # the last matched RAM block: its kids are `parent`'s children
        block: Block | None
        chain: dict[int, BlockHash] | None = None  # hashes from where RAM first ended
        lower_at: dict[int, LowerEntry] = {}
        while pos + bs <= n:
            end = pos + bs
            extra = extra_keys_for(spans, pos, end) if spans else ()
            want = buf[pos * 4 : end * 4]
            # RAM first, by content (its hash is hash_block(parent, want, extra))
            if prev is None:
                block = find_child(parent, want)
            else:  # a block in the pool's map keeps its children index itself
                kids = prev.kids
                if kids is None:
                    block = None
                elif isinstance(kids, list):
                    block = next((k for k in kids if k.tokens == want), None)
                else:
                    block = kids if kids.tokens == want else None
            entry: Entry | None
            if (block is not None and block.start == pos and block.extra_keys == extra
                    and (block.ns is ns or block.ns == ns) and not expired(block, now)):
                # found through the children index: hashed and in the map
                entry = prev = block
                h = block.block_hash
                trunc = bool(block.flags & 1)
                at_end = bool(block.flags & 3)
            else:
                prev = None
                known = chain.get(pos) if chain is not None else None
                h = known if known is not None else block_hash(parent, arr[pos:end], extra)
                block = self.pool.get(h)  # e.g. a sibling with the same tokens, other extra keys
                if (block is not None and block.parent_hash == parent and block.tokens == want
                        and self._ram_ok(block, pos, extra, ns, now)):
                    entry = prev = block
                    trunc = bool(block.flags & 1)
                    at_end = bool(block.flags & 3)
                else:
                    if self.lower and chain is None:
                        chain, lower_at = self._lower_chain(req, ns, spans, pos, parent, h)
                    entry = lower_at.get(pos)
                    if entry is None:
                        next_hash = h
                        break
                    trunc = entry.meta.truncatable
                    at_end = entry.meta.restorable_at_end()
            entries.append(entry)
            if end <= cap:
                if at_end:
                    best, best_len = end, len(entries)
            elif trunc:
                best, best_len = cap, len(entries)
            parent = h  # type: ignore[assignment]
            pos = end
        matched = pos
        walked = len(entries)
        # children of the last matched block: the longest common prefix with the rest
        rest = buf[pos * 4 :]
        diverged = False
        child_best: tuple[int, Entry] | None = None  # (restorable end, entry)
        if pos < n:
            top_lcp = -1
            for cand, c_tokens, c_extra, c_trunc, c_at_end in self.branches.children(
                    parent, pos, ns, now):
                lcp = lcp_tokens(c_tokens, rest)
                c_len = len(c_tokens) >> 2
                if lcp > top_lcp:
                    top_lcp = lcp
                    diverged = lcp < min(c_len, n - pos)
                if not lcp:
                    continue
                c_end = pos + c_len
                if c_extra != (extra_keys_for(spans, pos, c_end) if spans else ()):
                    # other extra keys: usable only before the first unshared span
                    lcp = min(lcp, _extra_key_limit(spans, pos, c_end, c_extra) - pos)
                    if lcp <= 0:
                        continue
                matched = max(matched, pos + lcp)
                reach = min(pos + lcp, cap)
                if reach <= pos:
                    continue
                if reach < c_end and not c_trunc:
                    continue
                if reach == c_end and not (c_trunc or c_at_end):
                    continue
                if reach > best and (child_best is None or reach > child_best[0]):
                    child_best = (reach, cand)
        if child_best is not None:
            best = child_best[0]
            entries.append(child_best[1])
            best_len = len(entries)
        if best < min(matched, cap) and walked:
            # a snapshot may end inside a walked block (a partial block at a message start)
            inner = self.branches.inner_snapshot(entries[:walked], best, cap, req, ns, spans,
                                                 now)
            if inner is not None:
                best = inner[0]
                del entries[inner[1]:]
                entries.append(inner[2])
                best_len = len(entries)
        del entries[best_len:]
        miss = None
        if best < cap:
            miss = self.branches.explain(best, matched, n, next_hash, parent, diverged, now)
        return RawMatch(entries, best, matched, miss)

    def stored_after(self, req: RequestTokens, ns: Namespace, spans: Sequence[ExtraKeySpan],
                     position: int, limit: int, now: float) -> list[int]:
        """Up to ``limit`` stored ids after ``req[:position]`` (the cached side of a divergence)."""
        bs = ns.block_size
        if not 0 <= position <= req.n or limit <= 0:
            return []
        start = (position // bs) * bs
        parent = ns.root
        for pos in range(0, start, bs):
            extra = extra_keys_for(spans, pos, pos + bs) if spans else ()
            parent = block_hash(parent, req.arr[pos:pos + bs], extra)
        return self.branches.stored_after(req, ns, parent, start, position, limit, now)


def _extra_key_limit(spans: Sequence[ExtraKeySpan], start: int, end: int,
                     stored: tuple[bytes, ...]) -> int:
    """Where a stored block over ``[start, end)`` with other extra keys stops being
    reusable: before the request's first span (paired by rank) whose key the block lacks;
    when all the request's spans agree but the block has more, the end of the last one."""
    rank = 0
    last_end = start
    for s in spans:
        if s.start < end and s.end > start:
            if rank >= len(stored) or stored[rank] != s.key:
                return max(start, s.start)
            rank += 1
            last_end = min(end, s.end)
    return last_end if rank < len(stored) else end
