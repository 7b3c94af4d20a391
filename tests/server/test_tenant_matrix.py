"""The cross-tenant matrix: with tenant-bound keys, nothing tenant A creates (stored
responses and their items, cached blocks, sessions, message ids, packs, stats rows) is
visible, deletable or usable by tenant B on any endpoint; A's objects are intact after
everything B tried. A real tiny engine with a RAM cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from real_engine import make_cache, tiny_engine

from promptcache.server import create_app
from promptcache.serving_config import ServerConfig

A = {"Authorization": "Bearer key-a", "X-Session-Id": "sess-alice-7"}
B = {"Authorization": "Bearer key-b", "X-Session-Id": "sess-bob-1"}
SECRET = "Alice's secret plan: the launch code is 4477 and the vault is under the old oak."
CHAT = {"model": "default", "max_tokens": 3,
        "messages": [{"role": "system", "content": SECRET}, {"role": "user", "content": "Go"}]}
MSG = {"model": "default", "max_tokens": 3, "system": SECRET,
       "messages": [{"role": "user", "content": "Go"}]}
RESP = {"model": "default", "max_output_tokens": 3, "instructions": SECRET, "input": "Go"}
BETA = {"anthropic-beta": "cache-diagnosis-2026-04-07"}


@pytest.fixture(scope="module")
def client(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({"key-a": "alice", "key-b": "bob"}))
    eng = tiny_engine(tiny_llama_path, make_cache())
    cfg = ServerConfig(api_keys_file=keys, api_key="key-admin", prerender=False)
    with TestClient(create_app(eng, cfg)) as c:
        yield c
    eng.close()


def cached(r: Any) -> int:
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_nothing_of_tenant_a_reaches_tenant_b(client: TestClient) -> None:
    # --- what A creates
    assert client.post("/v1/chat/completions", json=CHAT, headers=A).status_code == 200
    a_hit = cached(client.post("/v1/chat/completions", json=CHAT, headers=A))
    assert a_hit > 0
    msg_id = client.post("/v1/messages", json=MSG, headers={**A, **BETA}).json()["id"]
    resp = client.post("/v1/responses", json=RESP, headers=A).json()
    rid, item_id = resp["id"], resp["output"][0]["id"]
    pack = client.post("/v1/cache/export", json={"all": True}, headers=A)
    assert pack.status_code == 200 and int(pack.headers["X-Promptcache-Blocks"]) > 0

    # --- B, on every endpoint (probe first: B's own turn below caches the same prompt
    # in B's namespace)
    probe = client.post("/v1/cache/probe", json=CHAT, headers=B).json()
    assert probe["cached_tokens"] == 0 and probe["matched_tokens"] == 0
    assert cached(client.post("/v1/chat/completions", json=CHAT, headers=B)) == 0
    assert client.get(f"/v1/responses/{rid}", headers=B).status_code == 404
    assert client.delete(f"/v1/responses/{rid}", headers=B).status_code == 404
    assert client.post("/v1/responses", json={**RESP, "previous_response_id": rid},
                       headers=B).status_code == 404
    ref = {**RESP, "input": [{"type": "item_reference", "id": item_id}]}
    assert client.post("/v1/responses", json=ref, headers=B).status_code == 400  # unknown item
    diag = client.post("/v1/messages", json={**MSG, "diagnostics": {
        "previous_message_id": msg_id}}, headers={**B, **BETA}).json()
    assert diag["diagnostics"] == {"cache_miss_reason": {"type": "previous_message_not_found"}}
    listed = client.get("/v1/cache/sessions", headers=B).json()
    assert "sess-alice-7" not in json.dumps(listed) and "alice" not in json.dumps(listed)
    assert client.get("/v1/cache/sessions?tenant=alice", headers=B).status_code == 403
    for path in ("/v1/cache/stats", "/v1/dashboard/data"):
        body = json.dumps(client.get(path, headers=B).json())
        assert "sess-alice-7" not in body and "4477" not in body and rid not in body
        assert "alice" not in body
    metrics = client.get("/metrics", headers=B).text  # aggregates only: no tenant labels
    assert "alice" not in metrics and "sess-alice-7" not in metrics
    assert client.delete("/v1/cache?tenant=alice", headers=B).status_code == 403
    assert client.delete("/v1/cache/sessions/sess-alice-7?tenant=alice",
                         headers=B).status_code == 403
    gone = client.delete("/v1/cache/sessions/sess-alice-7", headers=B).json()
    assert gone.get("deleted_blocks", 0) == 0
    assert client.delete("/v1/cache", headers=B).status_code == 200  # bob's own: none of A's
    empty = client.post("/v1/cache/export", json={"session_id": "sess-alice-7"}, headers=B)
    assert empty.status_code == 200 and int(empty.headers["X-Promptcache-Blocks"]) == 0
    imported = client.post("/v1/cache/import", content=pack.content,
                           headers={**B, "content-type": "application/x-tar"})
    assert imported.status_code == 403
    # B's own blocks of that prompt were deleted with its cache: nothing to hit
    assert cached(client.post("/v1/chat/completions", json=CHAT, headers=B)) == 0

    # --- A's objects are intact
    assert client.get(f"/v1/responses/{rid}", headers=A).json()["id"] == rid
    assert cached(client.post("/v1/chat/completions", json=CHAT, headers=A)) >= a_hit
    assert "sess-alice-7" in json.dumps(client.get("/v1/cache/sessions", headers=A).json())
    # --- the global admin key sees everyone's: it names the tenant
    admin = {"Authorization": "Bearer key-admin", "X-Tenant-Id": "alice"}
    assert client.get(f"/v1/responses/{rid}", headers=admin).json()["id"] == rid
    assert "sess-alice-7" in json.dumps(client.get("/v1/cache/sessions?tenant=alice",
                                                   headers={"Authorization": "Bearer key-admin"}
                                                   ).json())
