"""Retention pins on the SSD tier (``prompt_cache_retention: 24h``): a pinned block
survives capacity eviction of unpinned blocks and the TTL until its pin ends, its
``pinned_until`` is in the index (shared, kept across restarts), a pin only grows,
pins never make a write fail, and explicit deletion still deletes pinned blocks.
Every test runs on a clock it controls (no sleeps)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from ssd_helpers import NS, NS_BOB, FakeClock, chain, make_tier, payload_for

from promptcache.tiers import ssd_files as files
from promptcache.tiers.ssd import SSDTier
from promptcache.tiers.ssd_index import SSDIndex
from promptcache.tiers.ssd_schema import SCHEMA_VERSION

SIZE = len(payload_for(0))
DAY = 86400.0


def live(tier: SSDTier, metas: list) -> list[int]:  # type: ignore[type-arg]
    return [i for i, m in enumerate(metas) if tier.get_meta(m.block_hash) is not None]


def put_all(tier: SSDTier, metas: list, clock: FakeClock, sessions: tuple[str, ...] = ()  # type: ignore[type-arg]
            ) -> None:
    for i, m in enumerate(metas):
        tier.put(m, payload_for(i % 8), sessions)
        tier.flush()
        clock.advance(1)


def pinned_until(tier: SSDTier, meta) -> float | None:  # type: ignore[no-untyped-def]
    row = tier.catalog.index.get(bytes(meta.block_hash))
    assert row is not None
    return row.pinned_until


def test_pinned_blocks_survive_a_storm_and_go_after_the_pin(tmp_path: Path) -> None:
    clock = FakeClock()
    tier = make_tier(tmp_path, budget_bytes=5 * SIZE, clock=clock)
    pinned = chain(NS, 3)
    put_all(tier, pinned, clock)
    t_pin = clock.t
    assert tier.pin([m.block_hash for m in pinned], DAY) == 3
    assert [pinned_until(tier, m) for m in pinned] == [t_pin + DAY] * 3
    storm = chain(NS, 6, first_token=1000)
    put_all(tier, storm, clock)  # 9 blocks into a 5-block budget
    # the three pinned blocks are the oldest, yet the storm's oldest go instead
    assert live(tier, pinned) == [0, 1, 2]
    assert live(tier, storm) == [4, 5]
    s = tier.stats()
    assert (s["evictions_capacity"], s["evictions_pinned"]) == (4, 0)
    assert (s["pinned_blocks"], s["pinned_bytes"], s["blocks_on_disk"]) == (3, 3 * SIZE, 5)
    # a day later the pin has ended: they are ordinary least recently used blocks
    clock.t = t_pin + DAY
    assert tier.stats()["pinned_blocks"] == 0
    more = chain(NS, 3, first_token=2000)
    put_all(tier, more, clock)
    assert live(tier, pinned) == []
    assert live(tier, storm) == [4, 5] and live(tier, more) == [0, 1, 2]
    s = tier.stats()
    assert (s["evictions_capacity"], s["evictions_pinned"]) == (7, 0)
    tier.close()


def test_a_pin_survives_a_restart(tmp_path: Path) -> None:
    clock = FakeClock()
    tier = make_tier(tmp_path, budget_bytes=4 * SIZE, clock=clock)
    pinned = chain(NS, 2)
    put_all(tier, pinned, clock)
    t_pin = clock.t
    tier.pin([m.block_hash for m in pinned], DAY)
    tier.close()
    clock.advance(3600)
    tier = make_tier(tmp_path, budget_bytes=4 * SIZE, clock=clock)
    assert [pinned_until(tier, m) for m in pinned] == [t_pin + DAY] * 2
    assert tier.stats()["pinned_blocks"] == 2
    storm = chain(NS, 5, first_token=1000)
    put_all(tier, storm, clock)
    assert live(tier, pinned) == [0, 1] and live(tier, storm) == [3, 4]
    tier.close()
    idx = SSDIndex(tmp_path / files.INDEX_NAME, durable=False)
    assert idx.kv_get("schema_version") == SCHEMA_VERSION == "3"
    idx.close()


def test_ttl_shorter_than_the_pin_does_not_expire_pinned_blocks(tmp_path: Path) -> None:
    clock = FakeClock()
    tier = make_tier(tmp_path, ttl_seconds=100.0, clock=clock, sweep_interval_s=1e9)
    pinned = chain(NS, 2)
    other = chain(NS, 2, first_token=1000)
    put_all(tier, pinned, clock)
    put_all(tier, other, clock)
    t_pin = clock.t
    tier.pin([m.block_hash for m in pinned], DAY)
    clock.advance(1000)  # far past the TTL
    assert tier.sweep() == 2
    assert live(tier, pinned) == [0, 1] and live(tier, other) == []
    assert tier.get(pinned[0].block_hash) == payload_for(0)
    # a read refreshes the TTL, and never below the pin
    tier.sweep()
    row = tier.catalog.index.get(bytes(pinned[0].block_hash))
    assert row is not None and row.expiry == t_pin + DAY
    clock.t = t_pin + DAY - 1
    assert tier.sweep() == 0 and live(tier, pinned) == [0, 1]
    clock.t = t_pin + DAY
    assert tier.sweep() == 2 and live(tier, pinned) == []
    assert tier.stats()["evictions_ttl"] == 4
    tier.close()


def test_a_shorter_pin_does_not_shorten_an_existing_one(tmp_path: Path) -> None:
    clock = FakeClock()
    tier = make_tier(tmp_path, clock=clock)
    ms = chain(NS, 2)
    put_all(tier, ms, clock)
    t0 = clock.t
    tier.pin([m.block_hash for m in ms], DAY)
    clock.advance(60)
    tier.pin([m.block_hash for m in ms], 600.0)
    assert [pinned_until(tier, m) for m in ms] == [t0 + DAY] * 2
    clock.advance(60)
    tier.pin([ms[0].block_hash], DAY)  # a later 24 h request extends it
    assert [pinned_until(tier, m) for m in ms] == [t0 + 120 + DAY, t0 + DAY]
    # a re-write of the block (same hash) keeps the pin
    tier.put(ms[1], payload_for(1))
    tier.flush()
    assert pinned_until(tier, ms[1]) == t0 + DAY
    tier.close()


def test_a_pin_before_the_write_is_applied_when_the_row_is_committed(tmp_path: Path) -> None:
    clock = FakeClock()
    tier = make_tier(tmp_path, clock=clock)
    ms = chain(NS, 2)
    t0 = clock.t
    assert tier.pin([m.block_hash for m in ms], DAY) == 0  # nothing stored yet
    clock.advance(5)
    put_all(tier, ms, clock)
    assert [pinned_until(tier, m) for m in ms] == [t0 + DAY] * 2
    assert tier.catalog.pins == {}
    tier.close()


def test_pins_never_fail_a_write_the_pin_ending_first_goes_first_tail_first(
        tmp_path: Path) -> None:
    clock = FakeClock()
    tier = make_tier(tmp_path, budget_bytes=3 * SIZE, clock=clock)
    a = chain(NS, 2)
    b = chain(NS, 2, first_token=1000)
    put_all(tier, a, clock)
    tier.pin([m.block_hash for m in a], DAY)
    clock.advance(10)
    put_all(tier, b[:1], clock)
    tier.pin([b[0].block_hash], DAY)
    # the budget holds only pinned blocks now: a new block still gets in; a's pin ends
    # first, and its tail goes before its head
    c = chain(NS, 1, first_token=2000)
    put_all(tier, c, clock)
    assert live(tier, a) == [0] and live(tier, b) == [0] and live(tier, c) == [0]
    s = tier.stats()
    assert (s["evictions_capacity"], s["evictions_pinned"], s["dropped_spills_total"]) == (1, 1, 0)
    tier.put(b[1], payload_for(1))
    tier.flush()  # c (unpinned) goes before any pinned block
    assert live(tier, a) == [0] and live(tier, b) == [0, 1] and live(tier, c) == []
    tier.close()


def test_session_tenant_purge_and_discard_delete_pinned_blocks(tmp_path: Path) -> None:
    clock = FakeClock()
    tier = make_tier(tmp_path, clock=clock)
    alice = chain(NS, 2)
    bob = chain(NS_BOB, 2)
    put_all(tier, alice, clock, sessions=("conv",))
    put_all(tier, bob, clock)
    tier.pin([m.block_hash for m in alice + bob], DAY)
    assert tier.delete_session("conv", "alice") == 2
    assert live(tier, alice) == []
    assert tier.delete_tenant("bob") == 2
    assert live(tier, bob) == [] and tier.stats()["pinned_blocks"] == 0
    more = chain(NS, 3, first_token=500)
    put_all(tier, more, clock)
    tier.pin([m.block_hash for m in more], DAY)
    assert tier.discard([more[2].block_hash]) == 1  # a superseded partial tail
    clock.advance(10)
    assert tier.purge(older_than_s=5) == 2  # an operator's purge
    assert live(tier, more) == [] and tier.stats()["pinned_blocks"] == 0
    tier.close()


def test_a_version_2_index_gains_the_column_without_losing_rows(tmp_path: Path) -> None:
    clock = FakeClock()
    tier = make_tier(tmp_path, clock=clock)
    ms = chain(NS, 3)
    put_all(tier, ms, clock)
    tier.close()
    db = sqlite3.connect(str(tmp_path / files.INDEX_NAME))
    db.execute("DROP INDEX blocks_pinned")
    db.execute("ALTER TABLE blocks DROP COLUMN pinned_until")
    db.execute("UPDATE kv SET value='2' WHERE key='schema_version'")
    db.commit()
    db.close()
    tier = make_tier(tmp_path, clock=clock)
    assert live(tier, ms) == [0, 1, 2]
    assert [pinned_until(tier, m) for m in ms] == [None] * 3
    assert tier.pin([ms[0].block_hash], DAY) == 1
    assert pinned_until(tier, ms[0]) == clock.t + DAY
    assert tier.check(fix=False).problems == 0
    s = tier.stats()
    assert (s["blocks_on_disk"], s["bytes_on_disk"]) == (3, 3 * SIZE)
    tier.close()
    idx = SSDIndex(tmp_path / files.INDEX_NAME, durable=False)
    assert idx.kv_get("schema_version") == "3"
    idx.close()
