"""Fail open: Redis down at start, killed and restarted, slow (a delaying proxy), full
(maxmemory: LRU eviction and noeviction). Time is the breaker's injected clock; no
assertion depends on how long anything took."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from redis_helpers import chain, ns, payload
from redis_servers import DelayProxy, RedisServer, free_port

from promptcache import codec
from promptcache.cache.types import NumpyAdapter
from promptcache.errors import TierError
from promptcache.meta import BlockMeta
from promptcache.tiers.redis import RedisTier
from promptcache.tiers.redis_client import CLOSED, HALF_OPEN, OPEN, CircuitBreaker

Make = Callable[..., RedisTier]


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def big_payload(meta: BlockMeta, kib: int) -> bytes:
    arr = np.full(kib * 256, meta.start, dtype=np.float32)
    return codec.encode(meta, (), *NumpyAdapter().to_buffer({"0.k": arr})[::-1])


# -- the breaker alone ---------------------------------------------------------------------

def test_breaker_transitions_and_backoff() -> None:
    clock = FakeClock()
    b = CircuitBreaker(failures=3, backoff_s=1.0, max_backoff_s=4.0, clock=clock)
    b.record_failure()
    b.record_failure()
    b.record_success()  # a success resets the run of failures
    b.record_failure()
    b.record_failure()
    assert b.state == CLOSED and b.allow()
    b.record_failure()
    assert (b.state, b.trips, b.retry_at) == (OPEN, 1, 1001.0)
    assert not b.allow() and b.skipped == 1
    assert not b.begin_probe()  # backoff not over
    clock.t = 1001.0
    assert b.begin_probe() and b.state == HALF_OPEN
    assert not b.allow()  # requests still skip while the probe runs
    b.end_probe(False)
    assert (b.state, b.backoff, b.retry_at) == (OPEN, 2.0, 1003.0)
    for expected in (4.0, 4.0):  # doubled, then capped
        clock.t = b.retry_at
        assert b.begin_probe()
        b.end_probe(False)
        assert b.backoff == expected
    clock.t = b.retry_at
    assert b.begin_probe()
    b.end_probe(True)
    assert (b.state, b.backoff, b.recoveries, b.probe_failures, b.probes) == (CLOSED, 1.0, 1, 3, 4)
    assert b.allow()


# -- a real server ----------------------------------------------------------------------------

def test_down_at_start_then_up(make_tier: Make, tmp_path: Path) -> None:
    port = free_port()  # nothing listens here yet
    clock = FakeClock()
    tier = make_tier(f"redis://127.0.0.1:{port}", clock=clock, start_prober=False,
                     breaker_failures=3, breaker_backoff_s=1.0)
    space = ns()
    metas = chain(space, list(range(8)))
    hs = [m.block_hash for m in metas]
    for _ in range(3):
        with pytest.raises(TierError):
            tier.get_metas(hs, ns=space)
    st = tier.stats()
    assert (st["state"], st["healthy"], st["connection_errors"], st["breaker_trips"]) == (
        "open", False, 3, 1)
    # open: answered at once, nothing attempted
    assert tier.get_metas(hs, ns=space) == [None, None]
    assert tier.get_many(hs, ns=space) == [None, None]
    assert tier.children(space.root, ns=space) == []
    assert not tier.put(metas[0], payload(metas[0]))
    st = tier.stats()
    assert (st["skipped_ops"], st["round_trips"]) == (3, 0)
    assert st["dropped_writes_by_reason"]["circuit_open"] == 1
    assert tier.probe() is None  # not due yet
    clock.t += 1.0
    assert tier.probe() is False  # still down: the backoff doubles
    assert tier.stats()["breaker_backoff_s"] == 2.0
    srv = RedisServer(tmp_path / "late", port=port).start()
    try:
        clock.t += 1.0
        assert tier.probe() is None
        clock.t += 1.0
        assert tier.probe() is True
        assert tier.healthy
        for m in metas:
            assert tier.put(m, payload(m))
        tier.flush()
        assert tier.get_metas(hs, ns=space) == metas
        st = tier.stats()
        assert (st["breaker_recoveries"], st["probes"], st["probe_failures"]) == (1, 2, 1)
    finally:
        srv.stop()


def test_killed_and_restarted(make_tier: Make, tmp_path: Path) -> None:
    srv = RedisServer(tmp_path / "r").start()
    clock = FakeClock()
    try:
        tier = make_tier(srv.url, clock=clock, start_prober=False)
        space = ns()
        metas = chain(space, list(range(8)))
        hs = [m.block_hash for m in metas]
        for m in metas:
            tier.put(m, payload(m))
        tier.flush()
        assert tier.get_metas(hs, ns=space) == metas
        srv.kill()
        errors = 0
        for _ in range(5):  # fail, fail, fail (open), then skipped at once
            try:
                assert tier.get_metas(hs, ns=space) == [None, None]
            except TierError:
                errors += 1
        assert errors == 3 and not tier.healthy
        srv.start()  # same port, empty (no persistence)
        clock.t += 1.0
        assert tier.probe() is True
        assert tier.get_metas(hs, ns=space) == [None, None]  # a restart lost the data: misses
        for m in metas:
            tier.put(m, payload(m))
        tier.flush()
        assert tier.get_metas(hs, ns=space) == metas
        assert tier.get_many(hs, ns=space) == [(payload(m), []) for m in metas]
    finally:
        srv.stop()


def test_replies_delayed_past_the_timeout(make_tier: Make, redis_url: str,
                                          redis_server: RedisServer) -> None:
    writer = make_tier(redis_url)
    space = ns()
    metas = chain(space, list(range(8)))
    hs = [m.block_hash for m in metas]
    for m in metas:
        writer.put(m, payload(m))
    writer.flush()
    proxy = DelayProxy(redis_server.port).start()
    try:
        clock = FakeClock()
        # 0.5 s: ten times what a loaded machine needs for a loopback round trip through
        # the proxy (the undelayed reads must not time out); the delay is 4x that
        tier = make_tier(proxy.url, timeout_s=0.5, clock=clock, start_prober=False)
        assert tier.get_metas(hs, ns=space) == metas  # through the proxy, no delay
        proxy.delay_s = 2.0
        for _ in range(3):
            with pytest.raises(TierError):
                tier.get_metas(hs, ns=space)
        st = tier.stats()
        assert (st["timeouts"], st["state"]) == (3, "open")
        assert tier.get_many(hs, ns=space) == [None, None]  # skipped, no wait
        proxy.delay_s = 0.0
        clock.t += 1.0
        assert tier.probe() is True
        assert tier.get_metas(hs, ns=space) == metas
        assert tier.get_many(hs, ns=space) == [(payload(m), []) for m in metas]
    finally:
        proxy.stop()


def test_maxmemory_with_lru_eviction(make_tier: Make, tmp_path: Path) -> None:
    srv = RedisServer(tmp_path / "lru", "--maxmemory", "3mb",
                      "--maxmemory-policy", "allkeys-lru").start()
    try:
        tier = make_tier(srv.url)
        space = ns()
        metas = chain(space, list(range(4 * 200)))  # 200 blocks of ~64 KiB: 12.8 MB
        for m in metas:
            assert tier.put(m, big_payload(m, 64))
            if len(tier._pending) > 16:
                tier.flush()
        tier.flush()
        st = tier.stats()
        assert (st["writes"], st["errors"], st["dropped_writes_total"]) == (200, 0, 0)
        found = tier.get_metas([m.block_hash for m in metas], ns=space)
        present = [i for i, f in enumerate(found) if f is not None]
        assert 0 < len(present) < 200  # Redis evicted some
        got = tier.get_many([metas[i].block_hash for i in present], ns=space)
        assert all(g is None or g == (big_payload(metas[i], 64), []) for g, i in zip(got, present,
                                                                                        strict=True))
        for m in metas:  # the children index may name evicted blocks: never returned
            kids = tier.children(m.parent_hash, ns=space)
            assert all(k.block_hash == m.block_hash for k in kids)
        assert tier.healthy and tier.stats()["errors"] == 0
    finally:
        srv.stop()


def test_maxmemory_noeviction_refuses_writes_reads_go_on(make_tier: Make,
                                                         tmp_path: Path) -> None:
    srv = RedisServer(tmp_path / "full", "--maxmemory", "2mb",
                      "--maxmemory-policy", "noeviction").start()
    try:
        tier = make_tier(srv.url)
        space = ns()
        first = chain(space, [7, 7, 7, 7])
        tier.put(first[0], payload(first[0]))
        tier.flush()
        metas = chain(space, list(range(4 * 100)))
        for m in metas:
            tier.put(m, big_payload(m, 64))
            tier.flush()
        st = tier.stats()
        assert st["oom_errors"] > 0 and st["dropped_writes_by_reason"]["error"] > 0
        assert st["state"] == "closed"  # full is not down: reads keep working
        assert tier.get_metas([first[0].block_hash], ns=space) == first
    finally:
        srv.stop()
