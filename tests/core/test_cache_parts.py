"""The parts of PromptCache on their own (cache/: policy, payloads, matcher + branches,
store and protect helpers): each built from only the collaborators it takes, with the
clock's ``now`` passed in."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from core_helpers import FakeTier, ns_of, payload_for

from promptcache.blocks.pool import TRUNCATABLE, Block, BlockPool, pack_tokens
from promptcache.blocks.tokens import to_request_tokens
from promptcache.cache import matcher
from promptcache.cache.branches import Branches
from promptcache.cache.entries import LowerEntry
from promptcache.cache.miss import COLD, DIVERGED, EXPIRED, GoneMemory
from promptcache.cache.ops import check_count
from promptcache.cache.payloads import Payloads
from promptcache.cache.policy import Expiry, Faults
from promptcache.cache.protect import Protect
from promptcache.cache.store import first_unstored
from promptcache.cache.types import ChainCursor
from promptcache.errors import TierError
from promptcache.hashing import BlockHash
from promptcache.meta import BlockMeta
from promptcache.stats import Counters

NS = ns_of(4)
SEQ = list(range(100, 112))  # three full blocks of 4


def _chain(pool: BlockPool, tokens: list[int], now: float) -> list[Block]:
    """Store ``tokens`` as a chain of unreferenced blocks (last access ``now``)."""
    parent, out = NS.root, []
    for start in range(0, len(tokens), 4):
        part = tokens[start:start + 4]
        h = matcher.block_hash(parent, np.asarray(part, dtype="<u4"), ())
        payload = payload_for(start, start + len(part), False)
        out.append(pool.allocate(block_hash=h, parent_hash=parent, tokens=pack_tokens(part),
                                 start=start, extra_keys=(), flags=TRUNCATABLE, ns=NS,
                                 payload=payload, nbytes=len(part) * 8, now=now))
        parent = h
    pool.release_chain(out)
    return out


def _parts(ttl: float | None = None, lower: Any = ()) -> tuple[BlockPool, matcher.Matcher,
                                                                Expiry, Counters]:
    c = Counters()
    pool, gone = BlockPool(1 << 20), GoneMemory(64)
    expiry = Expiry(ttl, pool, gone, c)
    faults = Faults(c)
    branches = Branches(pool, lower, gone, expired=expiry.expired, on_tier_error=faults.tier_error)
    m = matcher.Matcher(pool, lower, branches, expired=expiry.expired,
                        on_tier_error=faults.tier_error)
    return pool, m, expiry, c


def test_the_matcher_reads_the_time_it_is_given() -> None:
    pool, m, expiry, c = _parts(ttl=10.0)
    _chain(pool, SEQ, now=0.0)
    req = to_request_tokens(SEQ + [7])
    assert m.match(req, NS, (), now=5.0).num_tokens == 12
    late = m.match(req, NS, (), now=11.0)  # every block is past its ttl then
    assert late.num_tokens == 0 and late.miss is not None and late.miss.kind == EXPIRED
    assert m.match(req, NS, (), now=5.0).num_tokens == 12  # a pure query: nothing removed
    expiry.sweep(11.0)
    assert len(pool) == 0 and c.expired == 3
    assert m.match(req, NS, (), now=5.0).miss.kind == EXPIRED  # type: ignore[union-attr]


def test_the_matcher_finds_lower_tier_blocks_and_counts_a_failing_tier() -> None:
    tier = FakeTier()
    pool, m, _, c = _parts(lower=[tier])
    blocks = _chain(pool, SEQ, now=0.0)
    for b in blocks:
        tier.put(b.meta(), b"x", ())
    for b in blocks[1:]:
        pool.remove(b)
    raw = m.match(to_request_tokens(SEQ + [7]), NS, (), now=0.0)
    assert raw.num_tokens == 12
    assert [type(e) for e in raw.entries] == [Block, LowerEntry, LowerEntry]
    tier.fail_meta = True
    raw = m.match(to_request_tokens(SEQ + [7]), NS, (), now=0.0)
    assert raw.num_tokens == 4 and c.tier_errors >= 1


def test_stored_after_and_a_cold_miss() -> None:
    pool, m, _, _ = _parts()
    _chain(pool, SEQ, now=0.0)
    other = to_request_tokens(SEQ[:6] + [1, 2, 3])
    assert m.stored_after(other, NS, (), 6, 4, now=0.0) == [106, 107, 108, 109]
    other_way = m.match(to_request_tokens([1, 2, 3, 4, 5]), NS, (), now=0.0)
    assert other_way.miss is not None and other_way.miss.kind == DIVERGED
    cold = _parts()[1].match(to_request_tokens([1, 2, 3, 4, 5]), NS, (), now=0.0)
    assert cold.num_tokens == 0 and cold.miss is not None and cold.miss.kind == COLD


def test_faults_count_and_never_raise() -> None:
    c = Counters()
    faults = Faults(c)
    faults.tier_error("t", TierError("down"))
    faults.old_format("t", ValueError("v2"))
    faults.old_format("t", ValueError("v2"))
    assert (c.tier_errors, c.old_format_blocks) == (1, 2)


def test_payloads_load_checks_the_block_hash() -> None:
    pool = BlockPool(1 << 20)
    block = _chain(pool, SEQ[:4], now=0.0)[0]
    payloads = Payloads()  # NumpyAdapter and the real codec
    data = payloads.source(block).encode()
    assert block.block_hash is not None
    payload, nbytes = payloads.load(data, block.block_hash)  # type: ignore[misc]
    assert np.array_equal(payload["0.k"], block.payload["0.k"]) and nbytes == 32
    assert payloads.load(data, BlockHash(bytes(32))) is None


def test_first_unstored_and_check_count() -> None:
    assert first_unstored(NS, SEQ, 8, ChainCursor(NS), "tier", (), 4) == (
        matcher.block_hash(NS.root, np.asarray(SEQ[:4], dtype="<u4"), ()), None)
    h = matcher.block_hash(NS.root, np.asarray(SEQ[:4], dtype="<u4"), ())
    assert first_unstored(NS, SEQ, 4, ChainCursor(NS, 4, h), "tier", (), 4) is None
    with pytest.raises(ValueError, match="cause"):
        first_unstored(NS, SEQ, 8, None, "", (), 4)
    check_count("n", None, allow_none=True)
    check_count("n", 3)
    for bad in (-1, True, 1.5, None):
        with pytest.raises(ValueError, match="n must be a non-negative integer"):
            check_count("n", bad)  # type: ignore[arg-type]


def test_pin_reports_failing_tiers_instead_of_raising() -> None:
    class Pinned(FakeTier):
        def __init__(self, fail: bool) -> None:
            super().__init__()
            self.fail, self.pins = fail, []

        def pin(self, hashes: list[BlockHash], seconds: float) -> None:
            if self.fail:
                raise TierError("no pins today")
            self.pins.append((tuple(hashes), seconds))

    good, bad, plain = Pinned(False), Pinned(True), FakeTier()
    from promptcache.cache.levels import Levels

    pool = BlockPool(1 << 20)
    protect = Protect(pool, [good, bad, plain], Levels(pool))
    h = BlockHash(bytes(range(32)))
    failed = protect.pin([h], 60.0)
    assert good.pins == [((h,), 60.0)]
    assert [(t, str(e)) for t, e in failed] == [(bad, "no pins today")]


def test_lower_entries_are_metadata_only() -> None:
    meta = BlockMeta(BlockHash(bytes(32)), NS.root, (1, 2, 3, 4), 0)
    e = LowerEntry(meta, FakeTier())
    assert (e.start, e.end) == (0, 4)
