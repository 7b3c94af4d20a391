"""The Redis tier against a real redis-server: records, keys, TTL, sessions, tenants,
integrity checks, drops."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from redis_helpers import Source, chain, ns, payload
from redis_servers import RedisServer, wait_until

from promptcache.config import RedisConfig
from promptcache.errors import CorruptBlockError
from promptcache.hashing import CACHE_FORMAT_VERSION
from promptcache.tiers.redis import RedisTier
from promptcache.tiers.redis_keys import KeySpace

Make = Callable[..., RedisTier]


def keys_of(srv: RedisServer, pattern: str = "*") -> list[str]:
    return sorted(k.decode() for k in srv.client().scan_iter(match=pattern))


def put_all(tier: RedisTier, metas, sessions=()) -> None:  # type: ignore[no-untyped-def]
    for m in metas:
        assert tier.put(m, payload(m), sessions)
    tier.flush()


def test_round_trip_keys_and_ttl(make_tier: Make, redis_url: str, redis_server: RedisServer) -> None:
    tier = make_tier(redis_url, ttl_seconds=3600)
    space = ns()
    metas = chain(space, list(range(10)))  # blocks of 4, 4 and a partial 2
    put_all(tier, metas, ["s1"])
    assert tier.get_metas([m.block_hash for m in metas], ns=space) == metas
    assert tier.get_many([m.block_hash for m in metas], ns=space) == [
        (payload(m), ["s1"]) for m in metas]
    assert tier.get(metas[2].block_hash, ns=space) == payload(metas[2])
    assert tier.children(metas[1].block_hash, ns=space) == [metas[2]]
    assert tier.children(space.root, ns=space) == [metas[0]]
    assert tier.sessions_of(metas[0].block_hash, ns=space) == ["s1"]
    base = f"promptcache:v{CACHE_FORMAT_VERSION}:default:{space.key}"
    ks = KeySpace("promptcache")
    assert keys_of(redis_server) == sorted(
        [f"{base}:b:{m.block_hash.hex()}" for m in metas]
        + [f"{base}:k:{m.parent_hash.hex()}" for m in metas]
        + [ks.session("default", "s1")]
    )
    client = redis_server.client()
    assert all(0 < client.ttl(k) <= 3600 for k in keys_of(redis_server))
    st = tier.stats()
    assert (st["writes"], st["hits"], st["corrupt"], st["dropped_writes_total"]) == (3, 4, 0, 0)
    assert st["bytes_written"] == sum(len(payload(m)) for m in metas)


def test_namespace_and_tenant_in_the_key(make_tier: Make, redis_url: str) -> None:
    tier = make_tier(redis_url)
    a, b, other_model = ns("alice"), ns("bob"), ns("alice", model="model-b")
    metas = chain(a, list(range(8)))
    put_all(tier, metas)
    hs = [m.block_hash for m in metas]
    assert tier.get_metas(hs, ns=a) == metas
    # the same hashes asked for in another namespace are not there (other keys)
    assert tier.get_metas(hs, ns=b) == [None, None]
    assert tier.get_metas(hs, ns=other_model) == [None, None]
    assert tier.get_many(hs, ns=b) == [None, None]
    assert tier.get_metas(hs) == [None, None]  # no namespace: the tier answers nothing


def test_payload_source_is_encoded_on_the_writer_thread(make_tier: Make, redis_url: str) -> None:
    tier = make_tier(redis_url)
    space = ns()
    (m,) = chain(space, [1, 2, 3, 4])
    threads: list[str] = []

    class Tracking(Source):
        def encode(self) -> bytes:
            threads.append(threading.current_thread().name)
            return super().encode()

    src = Tracking(payload(m))
    assert tier.put(m, src)
    tier.flush()
    assert threads == ["promptcache-redis-writer"]
    assert tier.get(m.block_hash, ns=space) == payload(m)


def test_corrupt_payload_is_detected_deleted_and_a_miss(
        make_tier: Make, redis_url: str, redis_server: RedisServer) -> None:
    tier = make_tier(redis_url)
    space = ns()
    metas = chain(space, list(range(8)))
    put_all(tier, metas)
    ks = KeySpace("promptcache")
    key = ks.block("default", space.key, metas[1].block_hash)
    client = redis_server.client()
    data = bytearray(client.hget(key, "p"))
    data[-1] ^= 0xFF
    client.hset(key, "p", bytes(data))
    with pytest.raises(CorruptBlockError):
        tier.get(metas[1].block_hash, ns=space)
    assert client.exists(key) == 0
    assert client.hexists(ks.kids("default", space.key, metas[0].block_hash),
                          metas[1].block_hash.hex()) == 0
    assert tier.get_metas([metas[1].block_hash], ns=space) == [None]
    # a truncated value: size mismatch, same outcome through get_many
    key0 = ks.block("default", space.key, metas[0].block_hash)
    client.hset(key0, "p", client.hget(key0, "p")[:-3])
    assert tier.get_many([metas[0].block_hash], ns=space) == [None]
    assert client.exists(key0) == 0
    assert tier.stats()["corrupt"] == 2


def test_corrupt_record_is_detected(make_tier: Make, redis_url: str,
                                    redis_server: RedisServer) -> None:
    tier = make_tier(redis_url)
    space = ns()
    metas = chain(space, list(range(8)))
    put_all(tier, metas)
    ks = KeySpace("promptcache")
    client = redis_server.client()
    key = ks.block("default", space.key, metas[0].block_hash)
    # a token id changed: the record no longer hashes to its key
    client.hset(key, "m", client.hget(key, "m").replace(b'"t":"AAAAAA', b'"t":"AQAAAA'))
    client.hset(ks.block("default", space.key, metas[1].block_hash), "m", b"\x00not json")
    assert tier.get_metas([m.block_hash for m in metas], ns=space) == [None, None]
    assert client.exists(key) == 0
    assert tier.stats()["corrupt"] == 2


def test_sessions_and_session_deletion(make_tier: Make, redis_url: str,
                                       redis_server: RedisServer) -> None:
    tier = make_tier(redis_url)
    space = ns()
    shared = chain(space, list(range(8)))
    put_all(tier, shared, ["s1"])
    tier.add_sessions(shared[0].block_hash, ["s2"], ns=space)
    tier.flush()
    assert tier.sessions_of(shared[0].block_hash, ns=space) == ["s1", "s2"]
    anonymous = chain(space, [9, 9, 9, 9])
    put_all(tier, anonymous)  # no session: never removed by a session deletion
    assert tier.delete_session("s1") == 1  # shared[1]; shared[0] still has s2
    assert tier.get_metas([m.block_hash for m in shared], ns=space) == [shared[0], None]
    assert tier.delete_session("s2") == 1
    assert tier.get_metas([shared[0].block_hash, anonymous[0].block_hash], ns=space) == [
        None, anonymous[0]]
    ks = KeySpace("promptcache")
    assert keys_of(redis_server) == sorted([
        ks.block("default", space.key, anonymous[0].block_hash),
        ks.kids("default", space.key, space.root),
    ])
    assert tier.delete_session("never-seen") == 0


def test_session_deletion_is_tenant_scoped(make_tier: Make, redis_url: str,
                                           redis_server: RedisServer) -> None:
    tier = make_tier(redis_url)
    a, b = ns("alice"), ns("bob")
    ma, mb = chain(a, [1, 2, 3, 4]), chain(b, [1, 2, 3, 4])
    put_all(tier, ma, ["chat"])
    put_all(tier, mb, ["chat"])
    assert tier.delete_session("chat", tenant="alice") == 1
    assert tier.get_metas([ma[0].block_hash], ns=a) == [None]
    assert tier.get_metas([mb[0].block_hash], ns=b) == mb
    assert keys_of(redis_server, "promptcache:*:alice:*") == []
    assert tier.delete_session("chat") == 1  # every tenant
    assert keys_of(redis_server) == []


def test_tenant_deletion_leaves_no_key(make_tier: Make, redis_url: str,
                                       redis_server: RedisServer) -> None:
    tier = make_tier(redis_url)
    a, b = ns("alice"), ns("bob")
    put_all(tier, chain(a, list(range(30))), ["x"])
    put_all(tier, chain(b, list(range(30))), ["x"])
    assert tier.delete_tenant("alice") == 8
    assert keys_of(redis_server, "promptcache:*:alice:*") == []
    assert len(keys_of(redis_server, "promptcache:*:bob:*:b:*")) == 8
    assert tier.delete_tenant(None) == 8
    assert keys_of(redis_server) == []


def test_discard(make_tier: Make, redis_url: str) -> None:
    tier = make_tier(redis_url)
    space = ns()
    metas = chain(space, list(range(6)))
    put_all(tier, metas)
    assert tier.discard([metas[1].block_hash], ns=space) == 1
    tier.flush()
    assert tier.get_metas([m.block_hash for m in metas], ns=space) == [metas[0], None]
    assert tier.children(metas[0].block_hash, ns=space) == []  # the stale index entry goes
    assert tier.stats()["stale_children"] == 1


def test_a_second_put_replaces_the_block_and_keeps_its_sessions(
        make_tier: Make, redis_url: str) -> None:
    tier = make_tier(redis_url)
    space = ns()
    (m,) = chain(space, [5, 6, 7, 8])
    put_all(tier, [m], ["s1"])
    from dataclasses import replace

    upgraded = replace(m, snapshot=True, nbytes=999)
    other = payload(chain(space, [1, 1, 1, 1])[0])
    assert tier.put(upgraded, other, ["s2"])
    tier.flush()
    assert tier.get_metas([m.block_hash], ns=space) == [upgraded]
    assert tier.get(m.block_hash, ns=space) == other
    assert tier.sessions_of(m.block_hash, ns=space) == ["s1", "s2"]


def test_drops_are_counted(make_tier: Make, redis_url: str) -> None:
    tier = make_tier(redis_url, queue_size=1, max_value_bytes=1000)
    space = ns()
    metas = chain(space, list(range(16)))
    big = b"x" * 1001
    assert not tier.put(metas[0], big)
    assert not tier.put(metas[0], Source(big))  # by its nbytes estimate
    with tier._write_lock:  # the writer blocks on its first batch
        assert tier.put(metas[1], payload(metas[1]))
        wait_until(lambda: tier._queue.qsize() == 0, what="the writer to take the batch")
        assert tier.put(metas[2], payload(metas[2]))
        assert not tier.put(metas[3], payload(metas[3]))
    tier.flush()
    drops = tier.stats()["dropped_writes_by_reason"]
    assert (drops["too_large"], drops["queue_full"]) == (2, 1)
    assert tier.get_metas([m.block_hash for m in metas[1:4]], ns=space) == [
        metas[1], metas[2], None]
    tier.close()
    assert not tier.put(metas[3], payload(metas[3]))
    assert tier.stats()["dropped_writes_by_reason"]["closed"] == 1


def test_unix_socket_url(make_tier: Make, redis_url: str, redis_server: RedisServer) -> None:
    assert redis_server.socket_path is not None
    tier = make_tier(f"unix://{redis_server.socket_path}")
    space = ns()
    metas = chain(space, [1, 2, 3, 4])
    put_all(tier, metas)
    assert tier.get_metas([metas[0].block_hash], ns=space) == metas


def test_two_tiers_share_blocks(make_tier: Make, redis_url: str) -> None:
    a, b = make_tier(redis_url), make_tier(redis_url)
    space = ns()
    metas = chain(space, list(range(12)))
    put_all(a, metas, ["s"])
    assert b.get_metas([m.block_hash for m in metas], ns=space) == metas
    assert b.get_many([m.block_hash for m in metas], ns=space) == [
        (payload(m), ["s"]) for m in metas]
    assert b.delete_session("s") == 3
    assert a.get_metas([metas[0].block_hash], ns=space) == [None]


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="url"):
        RedisConfig(url="http://x")
    with pytest.raises(ValueError, match="prefix"):
        RedisConfig(url="redis://x", prefix="a:b")
    with pytest.raises(ValueError, match="timeout_s"):
        RedisConfig(url="redis://x", timeout_s=0)
    assert RedisConfig(url="redis+cluster://h:1").is_cluster
    assert RedisConfig(url="redis://h:1", cluster=True).is_cluster
    assert not RedisConfig(url="rediss://h:1").is_cluster


def test_password_is_redacted_in_stats(make_tier: Make) -> None:
    tier = make_tier("redis://user:secret@127.0.0.1:1/0", start_prober=False)
    assert "secret" not in str(tier.stats())
