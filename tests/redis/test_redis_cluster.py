"""The tier against a real 3-master Redis Cluster started by the test: keys spread over
the masters, pipelines across slots, session / tenant deletion over every master."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from redis_helpers import chain, ns, payload
from redis_servers import RedisClusterProcs

from promptcache.tiers.redis import RedisTier

Make = Callable[..., RedisTier]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    procs = RedisClusterProcs(Path(tmp_path_factory.mktemp("cluster")))
    procs.start()
    try:
        yield procs
    finally:
        procs.stop()


def node_keys(cluster: RedisClusterProcs, pattern: str = "*") -> list[list[str]]:
    return [sorted(k.decode() for k in n.client().scan_iter(match=pattern)) for n in cluster.nodes]


def test_cluster_round_trip_and_deletion(make_tier: Make, cluster: RedisClusterProcs) -> None:
    a, b = make_tier(cluster.url), make_tier(cluster.url)  # two servers, one cluster
    alice, bob = ns("alice"), ns("bob")
    metas = chain(alice, list(range(4 * 40 + 2)))
    for m in metas:
        assert a.put(m, payload(m), ["chat"])
    bob_metas = chain(bob, list(range(4 * 5)))
    for m in bob_metas:
        assert a.put(m, payload(m), ["chat"])
    a.flush()
    assert a.stats()["cluster"] is True
    per_node = node_keys(cluster, "promptcache:*:alice:*:b:*")
    assert all(per_node) and sum(map(len, per_node)) == 41  # spread over all three masters
    hs = [m.block_hash for m in metas]
    assert b.get_metas(hs, ns=alice) == metas
    assert b.get_many(hs, ns=alice) == [(payload(m), ["chat"]) for m in metas]
    assert b.children(metas[-2].block_hash, ns=alice) == [metas[-1]]
    assert b.sessions_of(metas[0].block_hash, ns=alice) == ["chat"]
    b.add_sessions(metas[0].block_hash, ["other"], ns=alice)
    b.flush()
    assert a.sessions_of(metas[0].block_hash, ns=alice) == ["chat", "other"]
    assert b.delete_session("chat", tenant="alice") == 40  # metas[0] keeps "other"
    assert b.get_metas(hs[:2], ns=alice) == [metas[0], None]
    assert b.get_metas([m.block_hash for m in bob_metas], ns=bob) == bob_metas
    assert b.delete_tenant("alice") == 1
    assert node_keys(cluster, "promptcache:*:alice:*") == [[], [], []]
    assert b.delete_tenant(None) == 5
    assert node_keys(cluster) == [[], [], []]
