"""DELETE /v1/cache/sessions/{id} acts within one tenant, across RAM and SSD: a
tenant-bound key cannot delete another tenant's blocks of a session with the same id
(403 when it names that tenant), a global admin key may name the tenant, and a caller
without a key deletes within its X-Tenant-Id. The cache behind the app is a real
PromptCache over a real SSD tier (half of each tenant's blocks demoted to the SSD)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from promptcache.cache import PromptCache
from promptcache.config import CacheConfig, SSDConfig
from promptcache.meta import Namespace
from promptcache.server import create_app
from promptcache.serving_config import ServerConfig
from promptcache.tiers.ssd import SSDTier

BS = 4
ON_SSD = list(range(10, 26))  # 4 blocks, demoted to the SSD
IN_RAM = list(range(100, 116))  # 4 blocks, in RAM


def payload_for(start: int, end: int, snapshot: bool) -> dict[str, np.ndarray]:
    return {"0.k": np.full((1, 1, end - start, 2), float(start), dtype=np.float32)}


def ns(tenant: str) -> Namespace:
    return Namespace("server-model", BS, tenant=tenant)


def hits(cache: PromptCache, tenant: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for toks in (ON_SSD, IN_RAM):
        out.update(cache.lookup(toks + [0], ns(tenant)).tokens_by_tier)
    return out


@pytest.fixture
def cache(tmp_path: Path):  # type: ignore[no-untyped-def]
    ssd = SSDTier(SSDConfig(path=tmp_path / "ssd", fsync=False))
    cache = PromptCache(CacheConfig(block_size=BS, ram_budget_bytes=1 << 20), lower=[ssd])
    for tenant in ("alice", "bob"):  # the same tokens, the same session id
        cache.store(ns(tenant), ON_SSD, 16, payload_for, session_id="conv")
    cache.evict()
    for tenant in ("alice", "bob"):
        cache.store(ns(tenant), IN_RAM, 16, payload_for, session_id="conv")
    ssd.flush()
    for tenant in ("alice", "bob"):
        assert hits(cache, tenant) == {"ssd": 16, "ram": 16}
    yield cache
    cache.close(persist=False)


def app_with(cache: PromptCache, tmp_path: Path, **cfg) -> TestClient:  # type: ignore[no-untyped-def]
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"key-a": "alice", "key-b": "bob"}))
    engine = FakeEngine()
    engine.cache = cache  # type: ignore[assignment]
    return TestClient(create_app(engine, ServerConfig(api_keys_file=keys, **cfg)))


def test_a_tenant_bound_key_deletes_only_its_own_tenants_session(cache, tmp_path):
    c = app_with(cache, tmp_path, api_key="admin")
    r = c.delete("/v1/cache/sessions/conv", headers={"x-api-key": "key-a"})
    assert r.status_code == 200
    assert r.json() == {"deleted_blocks": 8, "session_id": "conv", "cache_enabled": True,
                        "tenant": "alice"}
    assert hits(cache, "alice") == {}
    assert hits(cache, "bob") == {"ssd": 16, "ram": 16}  # untouched, in RAM and on SSD
    # naming the other tenant, by parameter or header: refused, nothing deleted
    for kw in ({"params": {"tenant": "bob"}}, {"headers": {"X-Tenant-Id": "bob"}}):
        headers = {"x-api-key": "key-a", **kw.get("headers", {})}
        r = c.delete("/v1/cache/sessions/conv", headers=headers, params=kw.get("params"))
        assert r.status_code == 403
    assert hits(cache, "bob") == {"ssd": 16, "ram": 16}
    # bob's own key deletes bob's
    r = c.delete("/v1/cache/sessions/conv", headers={"x-api-key": "key-b"})
    assert r.json()["deleted_blocks"] == 8 and hits(cache, "bob") == {}


def test_a_global_admin_key_names_the_tenant_or_deletes_everywhere(cache, tmp_path):
    c = app_with(cache, tmp_path, api_key="admin")
    r = c.delete("/v1/cache/sessions/conv", params={"tenant": "bob"},
                 headers={"Authorization": "Bearer admin"})
    assert r.json()["deleted_blocks"] == 8 and r.json()["tenant"] == "bob"
    assert hits(cache, "bob") == {} and hits(cache, "alice") == {"ssd": 16, "ram": 16}
    r = c.delete("/v1/cache/sessions/conv", headers={"Authorization": "Bearer admin"})
    assert r.json() == {"deleted_blocks": 8, "session_id": "conv", "cache_enabled": True}
    assert hits(cache, "alice") == {}
    assert c.delete("/v1/cache/sessions/conv", params={"tenant": "../x"},
                    headers={"Authorization": "Bearer admin"}).status_code == 400


def test_without_keys_the_callers_tenant_header_scopes_the_deletion(cache, tmp_path):
    engine = FakeEngine()
    engine.cache = cache  # type: ignore[assignment]
    c = TestClient(create_app(engine, ServerConfig()))
    r = c.delete("/v1/cache/sessions/conv", headers={"X-Tenant-Id": "alice"})
    assert r.json()["deleted_blocks"] == 8 and r.json()["tenant"] == "alice"
    assert hits(cache, "alice") == {} and hits(cache, "bob") == {"ssd": 16, "ram": 16}
    assert c.delete("/v1/cache/sessions/conv").json()["deleted_blocks"] == 8  # every tenant
    assert hits(cache, "bob") == {}


def test_a_block_in_ram_and_on_ssd_is_deleted_and_counted_once(tmp_path):
    """Written through: each of the session's 5 blocks is in RAM and on the SSD; the
    deletion removes both copies and reports 5 blocks (it said 10)."""
    ssd = SSDTier(SSDConfig(path=tmp_path / "ssd", fsync=False))
    cache = PromptCache(CacheConfig(block_size=BS, ram_budget_bytes=1 << 20), lower=[ssd],
                        write_through=True)
    try:
        five = list(range(300, 320))
        assert cache.store(ns("alice"), five, 20, payload_for, session_id="s5") == 5
        # another session's 4 blocks: kept
        assert cache.store(ns("alice"), IN_RAM, 16, payload_for, session_id="other") == 4
        ssd.flush()
        assert cache.lookup(five + [0], ns("alice")).tokens_by_tier == {"ram": 20}
        assert ssd.stats()["blocks_on_disk"] == 9
        engine = FakeEngine()
        engine.cache = cache  # type: ignore[assignment]
        c = TestClient(create_app(engine, ServerConfig()))
        r = c.delete("/v1/cache/sessions/s5", headers={"X-Tenant-Id": "alice"})
        assert r.json() == {"deleted_blocks": 5, "session_id": "s5", "cache_enabled": True,
                            "tenant": "alice"}
        assert cache.lookup(five + [0], ns("alice")).num_tokens == 0
        assert ssd.stats()["blocks_on_disk"] == 4
        # some blocks only on the SSD, some in both: each counted once
        assert cache.store(ns("alice"), five, 20, payload_for, session_id="s5") == 5
        ssd.flush()
        cache.evict()  # every block now only on the SSD, then the first 2 back in RAM
        cache.release(cache.acquire(five[:8] + [0], ns("alice")))
        assert cache.lookup(five + [0], ns("alice")).tokens_by_tier == {"ram": 8, "ssd": 12}
        r = c.delete("/v1/cache/sessions/s5", headers={"X-Tenant-Id": "alice"})
        assert r.json()["deleted_blocks"] == 5
        assert ssd.stats()["blocks_on_disk"] == 4
    finally:
        cache.close(persist=False)
