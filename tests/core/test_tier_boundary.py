"""Exception safety at the tier boundary: each method of the Tier protocol in turn is
replaced by a failing double (it raises TierError, or — a tier breaking its contract
— RuntimeError). A request cycle (acquire, store, release) still succeeds, as a miss
where the failing method was needed to read, reference counts return to their values
before, nothing stays pinned, and every admin call still answers."""

from __future__ import annotations

from typing import Any

import pytest
from core_helpers import FakeTier, make_cache, ns_of, payload_for

from promptcache.errors import TierError

NS = ns_of(4)
SEQ = list(range(1, 13))
METHODS = ["get_meta", "get_metas", "children", "get", "put", "has_room", "flush",
           "sessions_of", "add_sessions", "discard", "delete_session",
           "delete_session_blocks", "delete_tenant", "stats", "close"]
READ_PATH = {"get_metas", "get", "sessions_of"}  # a lower-tier hit needs each of these
# (get_meta is in the protocol, but the cache asks get_metas: one call for a chain)


class FailingTier:
    """A FakeTier whose ``method`` raises ``error`` while ``armed``."""

    def __init__(self, method: str, error: type[Exception]) -> None:
        self.inner = FakeTier()
        self.name = "ssd"
        self.method = method
        self.error = error
        self.armed = False
        self.failures = 0

    def has_room(self, timeout: float | None = 0.0) -> bool:
        return True

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def __getattribute__(self, name: str) -> Any:
        if name in METHODS and object.__getattribute__(self, "armed") and \
                name == object.__getattribute__(self, "method"):
            def fail(*args: Any, **kw: Any) -> Any:
                self.failures += 1
                raise self.error(f"{name} failed")
            return fail
        if name in METHODS and name not in ("has_room", "flush"):
            return getattr(object.__getattribute__(self, "inner"), name)
        return object.__getattribute__(self, name)


def test_the_double_covers_the_whole_protocol():
    from promptcache.tiers.base import Tier

    protocol = {n for n in vars(Tier) if not n.startswith("_")}
    assert protocol == set(METHODS)


@pytest.mark.parametrize("error", [TierError, RuntimeError], ids=["TierError", "RuntimeError"])
@pytest.mark.parametrize("method", METHODS)
def test_one_failing_tier_method_fails_no_request_and_pins_nothing(method, error):
    tier = FailingTier(method, error)
    cache = make_cache(lower=[tier], write_through=True)
    cache.store(NS, SEQ, 12, payload_for, session_id="s")
    cache.evict()  # every block now only in the lower tier
    assert len(tier.inner.blocks) == 3
    tier.armed = True

    hit = cache.acquire(SEQ + [0], NS, session_id="s")  # promotes from the lower tier
    assert cache.pool.num_used_blocks == len(hit.blocks)
    if method in READ_PATH:  # (get_metas: the matcher still finds the head by children)
        assert hit.num_tokens == (4 if method == "get_metas" else 0)
        assert cache.stats().tier_errors >= 1
    else:
        assert hit.num_tokens == 12
    # the request goes on: the end-of-generation save, then the release
    cache.store(NS, SEQ + [50, 51], 14, payload_for, session_id="s2")
    cache.release(hit)
    assert cache.pool.num_used_blocks == 0 and cache.stats().ram_used_blocks == 0
    cache.check()

    # every admin call answers (a failing tier is counted, never raised)
    stats = cache.stats()
    if method == "stats":
        assert stats.tiers == {"ssd": {"error": "stats failed"}}
    cache.flush(timeout=5)
    cache.delete_session("s", tenant="default")
    cache.persist(timeout=5)
    cache.delete("default")
    cache.evict()
    cache.check()
    assert cache.pool.num_blocks == 0
    cache.close()
    # (delete_session: the cache asks delete_session_blocks of a tier that has it)
    if method not in ("stats", "close", "has_room", "flush", "discard", "children", "get_meta",
                      "delete_session"):
        assert tier.failures >= 1  # the double was really reached


class ManyTier(FakeTier):
    """A FakeTier with the optional batched read of a remote tier (``get_many``)."""

    def __init__(self) -> None:
        super().__init__("redis")
        self.error: type[Exception] | None = None
        self.many_calls = 0

    def get_many(self, block_hashes: Any, *, ns: Any = None) -> list[Any]:
        self.many_calls += 1
        if self.error is not None:
            raise self.error("get_many failed")
        out: list[Any] = []
        for h in block_hashes:
            entry = self.blocks.get(h)
            out.append(None if entry is None else (entry[1], sorted(entry[2])))
        return out


@pytest.mark.parametrize("error", [None, TierError, RuntimeError], ids=["ok", "TierError", "RuntimeError"])
def test_a_failing_get_many_is_a_counted_miss_and_pins_nothing(error):
    tier = ManyTier()
    cache = make_cache(lower=[tier], write_through=True)
    cache.store(NS, SEQ, 12, payload_for, session_id="s")
    cache.evict()
    assert len(tier.blocks) == 3
    tier.error = error
    hit = cache.acquire(SEQ + [0], NS)
    assert tier.many_calls == 1 and tier.gets == []  # one batched read, no single gets
    assert cache.pool.num_used_blocks == len(hit.blocks)
    if error is None:
        assert hit.num_tokens == 12 and cache.stats().tier_errors == 0
        assert all(b.sessions == ("s",) for b in hit._held)  # the sessions came along
    else:
        assert hit.num_tokens == 0 and cache.stats().tier_errors == 1
    cache.release(hit)
    assert cache.pool.num_used_blocks == 0
    cache.check()
    cache.close()
