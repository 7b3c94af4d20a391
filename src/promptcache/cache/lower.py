"""How ``PromptCache`` writes RAM blocks to its lower tiers without silent loss: each block
records the tiers holding it (``IN_TIER << i``; ``PERSISTED`` once all do). Write-through
(``offer``) never waits (the feeder retries when a tier has room); ``demote`` and
``persist`` wait within a bound. Tier writers never take the cache lock: no deadlock."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ..blocks.pool import PERSISTED, Block
from ..hashing import BlockHash
from ..stats import Counters
from ..tiers.base import PayloadSource, Tier
from .persist import NAMED_FAILURES, PROGRESS_EVERY_S, PersistReport, block_name
from .persist import missing as persist_missing

logger = logging.getLogger(__name__)

DEMOTE_TIMEOUT_S = 30.0  # an evicted block waits this long for room in a tier's queue
FEED_WAIT_S = 0.5  # the feeder re-checks for close/new work at least this often
# Block flag bits above the pool's: bit (IN_TIER << i) = lower tier i holds the block.
IN_TIER = 8
MAX_TIERS = 4
ALL_TIERS = ((1 << MAX_TIERS) - 1) * IN_TIER


def in_tiers(block: Block, n: int) -> list[int]:
    """Indices of the ``n`` lower tiers known to hold ``block`` (its flag bits)."""
    if block.flags & PERSISTED:
        return list(range(n))
    return [i for i in range(n) if block.flags & (IN_TIER << i)]


def mark_in_tier(block: Block, i: int, n: int) -> None:
    """Record that lower tier ``i`` (of ``n``) holds ``block``; ``PERSISTED`` once all do."""
    block.flags |= IN_TIER << i
    if all(block.flags & (IN_TIER << j) for j in range(n)):
        block.flags |= PERSISTED


@dataclass(eq=False)
class _Unwritten:
    block: Block
    left: set[int]  # write-through tiers that had no room yet
    refused: bool = False  # some tier refused it for good


class LowerWriter:
    def __init__(
        self,
        tiers: Sequence[Tier],
        source_of: Callable[[Block], PayloadSource],
        is_live: Callable[[Block], bool],
        lock: threading.RLock,
        counters: Counters,
        on_tier_error: Callable[[Tier, Exception], None],
        *,
        write_through: Iterable[int] = (),
        demote_timeout_s: float = DEMOTE_TIMEOUT_S,
    ) -> None:
        self.tiers = list(tiers)
        if len(self.tiers) > MAX_TIERS:
            raise ValueError(f"at most {MAX_TIERS} lower tiers, got {len(self.tiers)}")
        self.write_through = sorted(set(write_through))  # the tiers offer() writes to
        if any(not 0 <= i < len(self.tiers) for i in self.write_through):
            raise ValueError(f"write-through tier indices out of range: {self.write_through}")
        self._source_of = source_of
        self._is_live = is_live
        self._cond = threading.Condition(lock)
        self._c = counters
        self._on_tier_error = on_tier_error
        self.demote_timeout_s = demote_timeout_s
        self._unwritten: dict[BlockHash, _Unwritten] = {}
        self._thread: threading.Thread | None = None
        self._closing = False
        self.last_persist: PersistReport | None = None

    def _has_room(self, tier: Tier, timeout: float | None = 0.0) -> bool:
        fn = getattr(tier, "has_room", None)
        if fn is None:
            return True
        try:
            return bool(fn(timeout))
        except Exception as e:
            self._on_tier_error(tier, e)
            return True  # a broken tier: treat its refusal as final

    def _lacking(self, block: Block, targets: Iterable[int]) -> set[int]:
        have = set(in_tiers(block, len(self.tiers)))
        return {i for i in targets if i not in have}

    def _put(self, block: Block, targets: Iterable[int], timeout: float | None
             ) -> tuple[set[int], set[int], set[int]]:
        """Put ``block`` into ``targets`` (recorded on it); returns (accepted, no room, refused)."""
        meta = block.meta()
        source = self._source_of(block)
        accepted: set[int] = set()
        full: set[int] = set()
        refused: set[int] = set()
        for i in sorted(targets):
            tier = self.tiers[i]
            # puts run under the cache lock and a tier's writer only makes room, so room
            # seen here stays: a full queue is never tried, a refusal despite room is final
            if timeout == 0 and not self._has_room(tier):
                full.add(i)
                continue
            try:
                if timeout == 0:
                    ok = tier.put(meta, source, block.sessions, hits=block.hits)
                else:
                    ok = tier.put(meta, source, block.sessions, hits=block.hits, timeout=timeout)
            except Exception as e:
                self._on_tier_error(tier, e)
                refused.add(i)
                continue
            if ok:
                accepted.add(i)
                mark_in_tier(block, i, len(self.tiers))
            else:
                refused.add(i)
        return accepted, full, refused

    def _all(self) -> set[int]:
        return set(range(len(self.tiers)))

    def offer(self, block: Block) -> None:
        """A new or upgraded block to the write-through tiers lacking it; never waits, lock held."""
        if block.block_hash is None or not self.write_through:
            return
        left = self._lacking(block, self.write_through)
        if not left:
            return
        entry = _Unwritten(block, left)
        if self._unwritten:  # behind the blocks already waiting: the order is kept
            self._unwritten.pop(block.block_hash, None)
            self._unwritten[block.block_hash] = entry
            self._c.write_through_deferred += 1
            self._wake()
            return
        self._advance(entry, timeout=0.0)
        if entry.left:
            self._unwritten[block.block_hash] = entry
            self._c.write_through_deferred += 1
            self._wake()

    def offer_first(self, blocks: Sequence[Block]) -> None:
        """Protected blocks, head first, into every lower tier lacking them (any policy);
        without room they wait ahead of the write-through backlog. Never waits; lock held."""
        if not self.tiers:
            return
        waiting: dict[BlockHash, _Unwritten] = {}
        for block in blocks:
            if block.block_hash is None:
                continue
            left = self._lacking(block, self._all())
            if not left:
                continue
            if waiting:  # behind the protected blocks before it: the order is kept
                self._unwritten.pop(block.block_hash, None)
                waiting[block.block_hash] = _Unwritten(block, left)
                self._c.write_through_deferred += 1
                continue
            _, full, refused = self._put(block, left, 0.0)
            if refused:
                self._c.demotion_failures += len(refused)
            if full:
                self._unwritten.pop(block.block_hash, None)
                waiting[block.block_hash] = _Unwritten(block, full)
                self._c.write_through_deferred += 1
        if waiting:
            self._unwritten = {**waiting, **self._unwritten}
            self._wake()

    def _advance(self, entry: _Unwritten, timeout: float | None) -> None:
        _, full, refused = self._put(entry.block, self._lacking(entry.block, entry.left), timeout)
        entry.left = full
        if refused:
            entry.refused = True
            self._c.demotion_failures += len(refused)
        if not entry.left and not entry.refused:
            self._c.write_through += 1  # every write-through tier took it

    def _wake(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="promptcache-cache-feeder",
                                            daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def _run(self) -> None:
        while True:
            wait_on: list[Tier] = []
            with self._cond:
                while not self._unwritten and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                h, entry = next(iter(self._unwritten.items()))
                if not self._is_live(entry.block) or not self._lacking(entry.block, entry.left):
                    del self._unwritten[h]  # deleted, evicted (demoted) or written since
                    continue
                try:
                    self._advance(entry, timeout=0.0)
                except Exception:  # the feeder must survive anything
                    logger.exception("writing block %s to the lower tiers failed",
                                     block_name(entry.block))
                    entry.left = set()
                if entry.left:
                    wait_on = [self.tiers[i] for i in sorted(entry.left)]
                else:
                    del self._unwritten[h]
                    if not self._unwritten:
                        self._cond.notify_all()  # flush() waits for this
            for tier in wait_on:  # outside the cache lock: requests go on meanwhile
                self._has_room(tier, FEED_WAIT_S)

    def num_unwritten(self) -> int:
        return sum(1 for e in self._unwritten.values() if self._is_live(e.block))

    def _flush_tiers(self, deadline: float | None) -> bool:
        """Wait for every tier's own writer until ``deadline`` (monotonic); False when a
        tier did not drain or failed (counted as a tier error)."""
        ok = True
        for tier in self.tiers:
            fn = getattr(tier, "flush", None)
            if fn is None:
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                ok = bool(fn(left)) and ok
            except Exception as e:
                self._on_tier_error(tier, e)
                ok = False
        return ok

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (lock released meanwhile) until no block waits for room, then flush the tiers."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._unwritten:
            if self._thread is None or not self._thread.is_alive():
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._cond.wait(left)
        return self._flush_tiers(deadline) and not self._unwritten

    def demote(self, block: Block) -> tuple[int, int]:
        """An evicted unpersisted block into the tiers lacking it (back-pressure); lock held."""
        if block.block_hash is not None:
            entry = self._unwritten.get(block.block_hash)
            if entry is not None and entry.block is block:
                del self._unwritten[block.block_hash]
        accepted, _, refused = self._put(block, self._lacking(block, self._all()),
                                         self.demote_timeout_s)
        return len(accepted), len(refused)

    def persist(self, blocks: list[Block], timeout: float | None) -> PersistReport:
        """Put every unpersisted block into the tiers lacking it, then flush; lock held."""
        t0 = time.monotonic()
        deadline = None if timeout is None else t0 + timeout
        report = PersistReport(blocks=len(blocks))
        names = [getattr(t, "name", "tier") for t in self.tiers]
        if blocks:
            nbytes = sum(b.nbytes for b in blocks)
            logger.info("persisting %d RAM blocks (%.1f MB) to %s (at most %s)", len(blocks),
                        nbytes / 1e6, "+".join(names),
                        "no time limit" if timeout is None else f"{timeout:g} s")
        handed: list[Block] = []  # every tier accepted (now or before)
        failed: list[Block] = []
        last_log = t0
        for n, block in enumerate(blocks):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                report.timed_out = True
                failed.extend(blocks[n:])
                break
            _, _, refused = self._put(block, self._lacking(block, self._all()),
                                      None if left is None else max(left, 1e-3))
            if refused:
                failed.append(block)
            else:
                handed.append(block)
            now = time.monotonic()
            if now - last_log >= PROGRESS_EVERY_S:
                last_log = now
                logger.info("persisting: %d / %d blocks handed over", n + 1, len(blocks))
        self._unwritten.clear()
        # wait for the tiers' writers, then see what really arrived
        flushed = self._flush_tiers(deadline)
        if not flushed:
            report.timed_out = True
        missing = persist_missing(self.tiers, handed, self._on_tier_error)
        for block in handed:
            gone = missing.get(id(block))
            if not gone and block.persisted:
                report.written += 1
                continue
            for i in gone or ():  # accepted but not there: a later eviction tries again
                block.flags &= ~(PERSISTED | (IN_TIER << i))
            failed.append(block)
        order = {id(b): i for i, b in enumerate(blocks)}
        failed.sort(key=lambda b: order[id(b)])
        report.failed = len(failed)
        report.failed_names = [block_name(b) for b in failed[:NAMED_FAILURES]]
        report.seconds = time.monotonic() - t0
        self.last_persist = report
        if failed:
            logger.warning(
                "persist: %d of %d RAM blocks did not reach %s%s: %s%s", len(failed),
                len(blocks), "+".join(names), " (time limit reached)" if report.timed_out else "",
                ", ".join(report.failed_names), ", ..." if len(failed) > NAMED_FAILURES else "")
        elif blocks:
            logger.info("persisted %d RAM blocks in %.1f s", report.written, report.seconds)
        return report

    def stop(self) -> None:
        """Stop the feeder, without the cache lock (what it had not written stays for persist)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
