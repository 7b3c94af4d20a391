"""Sessions belong to a tenant: deleting a session acts within one tenant (RAM and a
lower tier), None = every tenant (a global admin)."""

from core_helpers import FakeTier, make_cache, ns_of, payload_for

A, B = ns_of(4, "alice"), ns_of(4, "bob")
SEQ = list(range(1, 13))


def stored(evict_first: int = 0):  # type: ignore[no-untyped-def]
    tier = FakeTier()
    cache = make_cache(lower=[tier])
    for ns in (A, B):  # the same tokens and the same session id in two tenants
        assert cache.store(ns, SEQ, 12, payload_for, session_id="conv") == 3
    if evict_first:
        assert cache.evict(evict_first) == evict_first
    return cache, tier


def test_a_tenants_session_deletion_leaves_the_other_tenant_alone_in_ram():
    cache, tier = stored()
    assert cache.delete_session("conv", tenant="alice") == 3
    assert cache.lookup(SEQ + [0], A).num_tokens == 0
    m = cache.lookup(SEQ + [0], B)
    assert (m.num_tokens, m.tiers) == (12, ["ram"] * 3)
    assert cache.delete_session("conv", tenant="alice") == 0
    cache.check()


def test_a_tenants_session_deletion_leaves_the_other_tenant_alone_in_lower_tiers():
    cache, tier = stored(evict_first=6)  # every block now only in the lower tier
    assert len(tier.blocks) == 6
    assert cache.delete_session("conv", tenant="bob") == 3
    assert cache.lookup(SEQ + [0], B).num_tokens == 0
    assert cache.lookup(SEQ + [0], A).tokens_by_tier == {"ssd": 12}
    assert sorted({m.tenant for m, _, _ in tier.blocks.values()}) == ["alice"]


def test_no_tenant_deletes_the_session_everywhere():
    cache, tier = stored(evict_first=3)  # alice's blocks below, bob's in RAM
    assert cache.delete_session("conv") == 6
    assert cache.lookup(SEQ + [0], A).num_tokens == cache.lookup(SEQ + [0], B).num_tokens == 0
    assert tier.blocks == {}
