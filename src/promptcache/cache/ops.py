"""Operations on the stored blocks besides a request's lookup and store: eviction (and the demotion
hook), deletion, quarantine, the RAM budget, session listing, persist, export / import."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..blocks.block import unpack_tokens
from ..blocks.pool import Block, BlockPool
from ..hashing import BlockHash
from ..meta import BlockMeta, Namespace
from ..stats import Counters
from ..tiers.base import LazyPayload, Tier
from .levels import Levels
from .lower import LowerWriter
from .miss import EVICTED, GoneMemory
from .payloads import Payloads, allocate_stored
from .policy import Faults, notify

logger = logging.getLogger(__name__)


def check_count(name: str, value: int | None, *, allow_none: bool = False) -> None:
    """A non-negative integer (or None where allowed), else ValueError."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        what = "a non-negative integer or None" if allow_none else "a non-negative integer"
        raise ValueError(f"{name} must be {what}, got {value!r}")


@dataclass(eq=False)
class Ops:
    """Eviction, deletion, quarantine, the RAM budget, session listing, export / import
    (the facade holds the lock and passes its clock's ``now``)."""

    pool: BlockPool
    lower: Sequence[Tier]
    levels: Levels
    writer: LowerWriter
    payloads: Payloads
    gone: GoneMemory
    faults: Faults
    counters: Counters
    observers: list[Any]
    on_evict: Callable[[BlockMeta, Any], None] | None = None

    def evicted(self, block: Block) -> None:
        """The demotion hook: every evicted block passes here exactly once."""
        self.counters.evictions += 1
        h = block.block_hash
        if self.observers and h is not None:
            notify(self.observers, "evicted", block.meta())
        if h is not None:
            self.gone.record(h, block.parent_hash, EVICTED)
        if self.lower and not block.persisted and h is not None:
            ok, failed = self.writer.demote(block)
            self.counters.demotions += ok
            self.counters.demotion_failures += failed
        elif not self.lower:
            self.counters.evicted_dropped += 1
        if self.on_evict is not None and h is not None:
            try:
                self.on_evict(block.meta(), block.payload)
            except Exception:
                logger.exception("on_evict hook failed for block %r", block)

    # ---- eviction, deletion ----------------------------------------------------
    def evict(self, num_blocks: int | None) -> int:
        done = 0
        while num_blocks is None or done < num_blocks:
            if self.pool.evict() is None:
                break
            done += 1
        return done

    def delete_session(self, session_id: str, tenant: str | None = None) -> int:
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ValueError(f"tenant must be a non-empty string or None, got {tenant!r}")
        # a block held by several tiers (RAM and the SSD copy of it) is one block
        deleted: set[bytes] = set()
        by_tier: dict[str, int] = {"ram": 0}
        for block in self.pool.blocks():
            if session_id in block.sessions and (tenant is None or block.ns.tenant == tenant):
                block.sessions = tuple(s for s in block.sessions if s != session_id)
                h = block.block_hash
                if not block.sessions and self.pool.remove(block):
                    by_tier["ram"] += 1
                    if h is not None:
                        deleted.add(bytes(h))
        unnamed = by_tier["ram"] - len(deleted)  # (RAM blocks always have a hash)
        for tier in self.lower:
            try:
                hashes = getattr(tier, "delete_session_blocks", None)
                if hashes is not None:
                    found = set(hashes(session_id, tenant))
                    deleted |= found
                    by_tier[tier.name] = len(found)
                else:  # a tier that only counts: counted as it says
                    n = int(tier.delete_session(session_id, tenant))
                    unnamed += n
                    by_tier[tier.name] = n
            except Exception as e:
                self.faults.tier_error(tier, e)
        logger.debug("session %s (tenant %s): %d blocks deleted, per tier %s", session_id,
                    tenant or "*", len(deleted) + unnamed, by_tier)
        return len(deleted) + unnamed

    def delete(self, tenant: str | None = None) -> int:
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ValueError(f"tenant must be a non-empty string or None, got {tenant!r}")
        count = 0
        for block in self.pool.blocks():
            if (tenant is None or block.ns.tenant == tenant) and self.pool.remove(block):
                count += 1
        self.levels.drop(lambda key: tenant is None or key[1] == tenant)
        for tier in self.lower:
            try:
                count += int(tier.delete_tenant(tenant))
            except Exception as e:
                self.faults.tier_error(tier, e)
        return count

    # ---- token history (speculative decoding's draft pool, ``engine/speculation/``) --
    def token_history(self, ns: Namespace, max_tokens: int, overlap: int = 16
                      ) -> list[tuple[int, ...]]:
        if max_tokens <= 0:
            return []
        seqs: list[list[int]] = []
        total = 0
        seen: set[BlockHash] = set()
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
                    self.faults.tier_error(tier, e)
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

    # ---- quarantine (``engine/payload/shadow.py``: a block that failed verification) ------
    def quarantine_chain(self, block_hash: BlockHash, ns: Namespace) -> int:
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
                    self.faults.tier_error(tier, e)
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
                self.faults.tier_error(tier, e)
        logger.warning("quarantined the chain from block %s: %d blocks",
                       block_hash.hex()[:16], len(present))
        return len(present)

    # ---- RAM budget (``autotune.py`` moves it within its bounds) -----------------
    def resize_ram(self, budget_bytes: int) -> int:
        pool = self.pool
        pool.shrink_to(budget_bytes)  # idle blocks, live state, then active blocks
        pool.budget_bytes = max(budget_bytes, pool.used_bytes + pool.outside_bytes)
        return pool.budget_bytes

    # ---- sessions (listing; ``sessions.py`` reaps idle ones) ---------------------
    def sessions(self, tenant: str | None = None) -> list[dict[str, Any]]:
        out: dict[tuple[str, str], dict[str, Any]] = {}

        def row(t: str, sid: str) -> dict[str, Any]:
            return out.setdefault((t, sid), {"tenant": t, "session_id": sid, "tiers": {}})

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
                self.faults.tier_error(tier, e)
        return [out[k] for k in sorted(out)]

    # ---- export / import (``packs.py`` builds portable packs on these three) -----
    def ram_metas(self, ns: Namespace, session_id: str | None = None) -> list[BlockMeta]:
        return [b.meta() for b in self.pool.blocks()
                if b.block_hash is not None and b.ns == ns
                and (session_id is None or session_id in b.sessions)]

    def persist(self, timeout: float | None) -> int:
        """Write every RAM block the lower tiers lack into them (``LowerWriter.persist``)."""
        if not self.lower:
            return 0
        blocks = [b for b in self.pool.blocks() if b.block_hash is not None and not b.persisted]
        report = self.writer.persist(blocks, timeout)
        self.counters.persisted_on_close += report.written
        self.counters.persist_failures += report.failed
        return report.written

    def ram_copy(self, block_hash: BlockHash, ns: Namespace
                 ) -> tuple[BlockMeta, LazyPayload, tuple[str, ...]] | None:
        """A RAM block as (meta, its payload to encode, sessions); None if not in RAM."""
        block = self.pool.get(block_hash)
        if block is None or block.ns != ns:
            return None
        return block.meta(), self.payloads.source(block), tuple(block.sessions)

    def read_lower(self, block_hash: BlockHash, ns: Namespace
                   ) -> tuple[BlockMeta, bytes, tuple[str, ...]] | None:
        """A block from the first lower tier that has it (bytes as stored)."""
        for tier in self.lower:
            try:
                found = tier.get_meta(block_hash, ns=ns)
                data = tier.get(block_hash, ns=ns) if found is not None else None
                if found is None or data is None:
                    continue
                return found, data, tuple(tier.sessions_of(block_hash, ns=ns))
            except Exception as e:
                self.faults.tier_error(tier, e)
        return None

    def import_block(self, meta: BlockMeta, data: bytes, sessions: Sequence[str],
                     ns: Namespace, now: float) -> bool:
        existing = self.pool.get(meta.block_hash)
        if existing is not None:
            for sid in sessions:
                existing.add_session(sid)
            return False
        loaded = self.payloads.load(data, meta.block_hash)
        if loaded is None:
            raise ValueError("the payload belongs to another block")
        payload, nbytes = loaded
        if self.pool.can_allocate(nbytes):
            block = allocate_stored(self.pool, meta, ns, payload, nbytes, now)
            for sid in sessions:
                block.add_session(sid)
            self.levels.on_new_block(block)
            self.gone.forget(meta.block_hash)
            if self.lower:
                self.writer.offer(block)
            self.pool.release_chain([block])
            return True
        stored = False
        for tier in self.lower:
            try:
                stored = bool(tier.put(meta, data, tuple(sessions), timeout=None)) or stored
            except Exception as e:
                self.faults.tier_error(tier, e)
        if not stored:
            self.counters.drops += 1
        return stored
