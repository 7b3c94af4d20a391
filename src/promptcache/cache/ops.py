"""Operations on the stored blocks: eviction, deletion, quarantine, the RAM budget,
session listing, export / import.

What the admin endpoints and the ops modules (``sessions.py``, ``autotune.py``,
``packs.py``, ``engine/shadow.py``) do to the cache besides a request's lookup and
store.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..blocks.block import unpack_tokens
from ..blocks.pool import SNAPSHOT, TRUNCATABLE
from ..hashing import BlockHash
from ..meta import BlockMeta, Namespace
from .base import CacheBase

logger = logging.getLogger(__name__)


class CacheOps(CacheBase):
    """Eviction, deletion, quarantine, the RAM budget, session listing, export / import."""

    # ---- eviction, deletion ----------------------------------------------------
    def evict(self, num_blocks: int | None = None) -> int:
        """Evict (demote) up to ``num_blocks`` LRU unreferenced blocks (None: all)."""
        if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0):
            raise ValueError(f"num_blocks must be a non-negative integer or None, got {num_blocks!r}")
        with self._lock:
            self._now = self._clock()
            self.levels.tick(self._now)
            done = 0
            while num_blocks is None or done < num_blocks:
                if self.pool.evict() is None:
                    break
                done += 1
            return done

    def delete_session(self, session_id: str, tenant: str | None = None) -> int:
        """Remove the session from the blocks of ``tenant`` (None: of every tenant) in
        every tier; blocks left with no session are deleted. Returns the number of
        blocks deleted (all tiers)."""
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ValueError(f"tenant must be a non-empty string or None, got {tenant!r}")
        with self._lock:
            count = 0
            for block in self.pool.blocks():
                if session_id in block.sessions and (tenant is None or block.ns.tenant == tenant):
                    block.sessions = tuple(s for s in block.sessions if s != session_id)
                    if not block.sessions and self.pool.remove(block):
                        count += 1
            for tier in self.lower:
                try:
                    count += int(tier.delete_session(session_id, tenant))
                except Exception as e:
                    self._on_tier_error(tier, e)
            return count

    def delete(self, tenant: str | None = None) -> int:
        """Delete every block of ``tenant`` (None: every block) in every tier."""
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ValueError(f"tenant must be a non-empty string or None, got {tenant!r}")
        with self._lock:
            count = 0
            for block in self.pool.blocks():
                if (tenant is None or block.ns.tenant == tenant) and self.pool.remove(block):
                    count += 1
            self.levels.drop(lambda key: tenant is None or key[1] == tenant)
            for tier in self.lower:
                try:
                    count += int(tier.delete_tenant(tenant))
                except Exception as e:
                    self._on_tier_error(tier, e)
            return count

    # ---- token history (speculative decoding's draft pool, ``engine/speculate.py``) --
    def token_history(self, ns: Namespace, max_tokens: int, overlap: int = 16
                      ) -> list[tuple[int, ...]]:
        """The token ids stored under ``ns`` (one model, format and tenant) in RAM and
        the lower tiers, as sequences: the chains from the namespace root, depth first;
        a block's first child continues its sequence, every other child starts a new
        one with the last ``overlap`` tokens before it (so n-grams reach across the
        branch point). Each block's tokens once, at most about ``max_tokens`` tokens in
        all (the walk stops there). Metadata only: no payload is read."""
        if max_tokens <= 0:
            return []
        seqs: list[list[int]] = []
        total = 0
        seen: set[BlockHash] = set()
        with self._lock:
            # (block, the last `overlap` tokens up to it, the sequence its first child
            # continues; -1 for none)
            stack: list[tuple[BlockHash, tuple[int, ...], int]] = [(ns.root, (), -1)]
            while stack and total < max_tokens:
                parent, tail, cont = stack.pop()
                kids: dict[BlockHash, tuple[int, ...]] = {}
                for b in self.pool.children(parent):
                    if b.block_hash is not None and b.ns == ns:
                        kids[b.block_hash] = unpack_tokens(b.tokens)
                for tier in self.lower:
                    try:
                        for m in tier.children(parent, ns=ns):
                            if m.namespace_key in ("", ns.key):
                                kids.setdefault(m.block_hash, m.token_ids)
                    except Exception as e:
                        self._on_tier_error(tier, e)
                first = True
                for h in sorted(kids):
                    if h in seen:
                        continue
                    seen.add(h)
                    toks = kids[h]
                    if first and cont >= 0:
                        at = cont
                    else:
                        seqs.append(list(tail))
                        total += len(tail)
                        at = len(seqs) - 1
                    first = False
                    seqs[at].extend(toks)
                    total += len(toks)
                    stack.append((h, (tail + toks)[-overlap:], at))
        return [tuple(s) for s in seqs if s]

    # ---- quarantine (``engine/shadow.py``: a block that failed verification) ------
    def quarantine_chain(self, block_hash: BlockHash, ns: Namespace) -> int:
        """Remove the block and every block chained after it (its descendants) from
        RAM and every lower tier, so nothing restores from it again. Returns the
        number of distinct blocks removed."""
        with self._lock:
            doomed: list[BlockHash] = []
            seen: set[BlockHash] = set()
            todo = [block_hash]
            while todo:
                h = todo.pop()
                if h in seen:
                    continue
                seen.add(h)
                doomed.append(h)
                todo.extend(b.block_hash for b in self.pool.children(h)
                            if b.block_hash is not None and b.ns == ns)
                for tier in self.lower:
                    try:
                        todo.extend(m.block_hash for m in tier.children(h, ns=ns))
                    except Exception as e:
                        self._on_tier_error(tier, e)
            present: set[BlockHash] = set()
            for h in doomed:
                block = self.pool.get(h)
                if block is not None and self.pool.remove(block):
                    present.add(h)
            for tier in self.lower:
                try:
                    present.update(m.block_hash for m in tier.get_metas(doomed, ns=ns)
                                   if m is not None)
                    tier.discard(doomed, ns=ns)
                except Exception as e:
                    self._on_tier_error(tier, e)
            logger.warning("quarantined the chain from block %s: %d blocks",
                           block_hash.hex()[:16], len(present))
            return len(present)

    # ---- RAM budget (``autotune.py`` moves it within its bounds) -----------------
    def resize_ram(self, budget_bytes: int) -> int:
        """Set the RAM budget; shrinking evicts (demotes) LRU blocks. Blocks in use are
        never evicted, so the budget set may stay above ``budget_bytes`` by what they
        hold. Returns the budget in force."""
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be a non-negative integer, got {budget_bytes!r}")
        with self._lock:
            self._now = self._clock()
            pool = self.pool
            while pool.used_bytes > budget_bytes and pool.evict() is not None:
                pass
            pool.budget_bytes = max(budget_bytes, pool.used_bytes)
            return pool.budget_bytes

    # ---- sessions (listing; ``sessions.py`` reaps idle ones) ---------------------
    def sessions(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """Every session with blocks, per tier: ``{"tenant", "session_id", "tiers":
        {"ram": {"blocks", "bytes"}, "<tier>": {"blocks", "bytes", "last_use"}}}`` (a
        lower tier that can list its sessions reports the wall-clock time its blocks
        were last used), sorted by tenant and session."""
        out: dict[tuple[str, str], dict[str, Any]] = {}

        def row(t: str, sid: str) -> dict[str, Any]:
            return out.setdefault((t, sid), {"tenant": t, "session_id": sid, "tiers": {}})

        with self._lock:
            for b in self.pool.blocks():
                if b.block_hash is None or (tenant is not None and b.ns.tenant != tenant):
                    continue
                for sid in b.sessions:
                    ram = row(b.ns.tenant, sid)["tiers"].setdefault("ram", {"blocks": 0, "bytes": 0})
                    ram["blocks"] += 1
                    ram["bytes"] += b.nbytes
            for tier in self.lower:
                listing = getattr(tier, "sessions", None)
                if listing is None:
                    continue
                try:
                    for t, sid, n, nbytes, last in listing(tenant):
                        row(t, sid)["tiers"][tier.name] = {"blocks": n, "bytes": nbytes,
                                                           "last_use": last}
                except Exception as e:
                    self._on_tier_error(tier, e)
        return [out[k] for k in sorted(out)]

    # ---- export / import (``packs.py`` builds portable packs on these three) -----
    def ram_metas(self, ns: Namespace, session_id: str | None = None) -> list[BlockMeta]:
        """The metadata of the RAM blocks of ``ns`` (of one session's, if given)."""
        with self._lock:
            return [b.meta() for b in self.pool.blocks()
                    if b.block_hash is not None and b.ns == ns
                    and (session_id is None or session_id in b.sessions)]

    def read_block(self, block_hash: BlockHash, ns: Namespace
                   ) -> tuple[BlockMeta, bytes, tuple[str, ...]] | None:
        """A stored block as ``(meta, payload bytes in the codec, sessions)``: from RAM
        (encoded here) or else the first lower tier that has it (bytes as stored,
        checksum-verified by the tier). None if no tier has it. The RAM LRU order
        does not change (a lower tier may count the read as a hit)."""
        with self._lock:
            block = self.pool.get(block_hash)
            ram = None
            if block is not None and block.ns == ns:
                ram = (block.meta(), self._source(block), tuple(block.sessions))
        if ram is not None:  # payloads are immutable: encode without holding the lock
            return ram[0], ram[1].encode(), ram[2]
        with self._lock:
            for tier in self.lower:
                try:
                    found = tier.get_meta(block_hash, ns=ns)
                    data = tier.get(block_hash, ns=ns) if found is not None else None
                    if found is None or data is None:
                        continue
                    return found, data, tuple(tier.sessions_of(block_hash, ns=ns))
                except Exception as e:
                    self._on_tier_error(tier, e)
            return None

    def import_block(self, meta: BlockMeta, data: bytes, sessions: Sequence[str],
                     ns: Namespace) -> bool:
        """Add one verified block (``packs.read_pack`` checked its chain hash, digest and
        namespace): into RAM when it fits (handed to the write-through tiers like a
        stored block), else straight into every lower tier (with back-pressure). A
        block already in RAM only gains the sessions. True if the block was added."""
        with self._lock:
            self._now = self._clock()
            existing = self.pool.get(meta.block_hash)
            if existing is not None:
                for sid in sessions:
                    existing.add_session(sid)
                return False
            block_hash, buffer, layout = self._decode_block(data)
            if block_hash != meta.block_hash:
                raise ValueError("the payload belongs to another block")
            payload = self.adapter.from_buffer(buffer, layout)
            nbytes = self.adapter.nbytes(payload)
            if self.pool.can_allocate(nbytes):
                flags = (TRUNCATABLE if meta.truncatable else 0) | (SNAPSHOT if meta.snapshot else 0)
                block = self.pool.allocate(
                    block_hash=meta.block_hash, parent_hash=meta.parent_hash,
                    tokens=np.asarray(meta.token_ids, dtype="<u4").tobytes(), start=meta.start,
                    extra_keys=tuple(meta.extra_keys), flags=flags, ns=ns, payload=payload,
                    nbytes=nbytes, now=self._now)
                for sid in sessions:
                    block.add_session(sid)
                self.levels.on_new_block(block)
                self.gone.forget(meta.block_hash)
                if self.lower:
                    self._writer.offer(block)
                self.pool.release_chain([block])
                return True
            stored = False
            for tier in self.lower:
                try:
                    stored = bool(tier.put(meta, data, tuple(sessions), timeout=None)) or stored
                except Exception as e:
                    self._on_tier_error(tier, e)
            if not stored:
                self._c.drops += 1
            return stored
