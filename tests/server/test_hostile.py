"""Hostile clients: bad fields, oversized and deeply nested bodies, wrong content types
and one tenant reaching for another's objects. Each case asserts the status, the API's
own error shape, and that the next good request is served."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from promptcache.server import create_app
from promptcache.serving_config import ServerConfig

CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
MSG = {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
RESP = {"model": "default", "input": "Hi", "max_output_tokens": 4}
A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}


def openai_error(r: Any, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return dict(err)


def anthropic_error(r: Any, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return dict(body["error"])


def served(c: TestClient, headers: dict[str, str] | None = None) -> None:
    r = c.post("/v1/chat/completions", json=CHAT, headers=headers or {})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


@pytest.fixture
def client(engine: FakeEngine) -> TestClient:
    return TestClient(create_app(engine, ServerConfig(max_body_bytes=8192)))


@pytest.fixture
def tenants(engine: FakeEngine, tmp_path: Path) -> TestClient:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"key-a": "alice", "key-b": "bob"}))
    return TestClient(create_app(engine, ServerConfig(api_keys_file=keys)))


# --- fields ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [-1, 2**64, 10**30])
def test_an_out_of_range_seed_is_a_400_and_never_reaches_the_engine(
        client: TestClient, engine: FakeEngine, seed: int) -> None:
    for path, body in (("/v1/chat/completions", CHAT),
                       ("/v1/completions", {"model": "default", "prompt": "Hi", "max_tokens": 4})):
        err = openai_error(client.post(path, json={**body, "seed": seed}), 400)
        assert "seed must be an integer in [0, 2**64)" in err["message"]
    assert engine.submitted == []
    served(client)


@pytest.mark.parametrize("field,value", [
    ("temperature", -1), ("temperature", 1e9), ("top_p", 0), ("top_p", 2),
    ("max_tokens", 0), ("max_tokens", -5), ("top_logprobs", 99),
])
def test_out_of_range_sampling_fields_are_400(client: TestClient, field: str,
                                              value: Any) -> None:
    body = {**CHAT, field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    openai_error(client.post("/v1/chat/completions", json=body), 400)
    served(client)


# --- sizes -------------------------------------------------------------------------------


def big_chat(n: int) -> bytes:
    return json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * n}]}).encode()


def test_an_oversized_body_is_a_413_before_it_is_read(client: TestClient,
                                                      engine: FakeEngine) -> None:
    data = big_chat(100 * 1024)
    err = openai_error(client.post("/v1/chat/completions", content=data,
                                   headers={"content-type": "application/json"}), 413)
    assert err["code"] == "request_too_large" and "8192 bytes" in err["message"]
    err = anthropic_error(client.post("/v1/messages", content=data,
                                      headers={"content-type": "application/json"}), 413)
    assert err["type"] == "request_too_large"
    assert engine.submitted == []
    served(client)


def test_a_chunked_body_is_cut_at_the_limit(client: TestClient, engine: FakeEngine) -> None:
    sent = {"chunks": 0}

    def chunks() -> Iterator[bytes]:
        data = big_chat(1024 * 1024)
        for i in range(0, len(data), 8192):
            sent["chunks"] += 1
            yield data[i:i + 8192]

    r = client.post("/v1/chat/completions", content=chunks(),
                    headers={"content-type": "application/json"})
    err = openai_error(r, 413)
    assert err["code"] == "request_too_large"
    assert engine.submitted == []
    served(client)


def test_a_body_just_under_the_limit_is_served(client: TestClient) -> None:
    data = big_chat(2000)
    assert len(data) < 8192
    r = client.post("/v1/chat/completions", content=data,
                    headers={"content-type": "application/json"})
    assert r.status_code == 200


def test_the_limit_applies_with_the_request_log_on(engine: FakeEngine, tmp_path: Path) -> None:
    c = TestClient(create_app(engine, ServerConfig(max_body_bytes=1024,
                                                   log_requests_dir=tmp_path)))

    def chunks() -> Iterator[bytes]:
        data = big_chat(8192)
        for i in range(0, len(data), 512):
            yield data[i:i + 512]

    openai_error(c.post("/v1/chat/completions", content=chunks(),
                        headers={"content-type": "application/json"}), 413)
    served(c)


# --- nesting and content types -----------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/cache/probe", "/v1/cache/export",
                                  "/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_deep_nesting_is_a_400(client: TestClient, path: str) -> None:
    data = "[" * 3000 + "]" * 3000
    r = client.post(path, content=data, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    served(client)


@pytest.mark.parametrize("path", ["/v1/cache/probe", "/v1/cache/export",
                                  "/v1/chat/completions", "/v1/messages"])
def test_a_cross_site_simple_content_type_is_refused(client: TestClient, path: str) -> None:
    body = json.dumps(CHAT if path != "/v1/messages" else MSG)
    r = client.post(path, content=body, headers={"content-type": "text/plain"})
    assert r.status_code == 415, r.text
    served(client)


# --- tenants -----------------------------------------------------------------------------


def test_stored_responses_belong_to_their_tenant(tenants: TestClient) -> None:
    r = tenants.post("/v1/responses", json=RESP, headers=A)
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    assert tenants.get(f"/v1/responses/{rid}", headers=B).status_code == 404
    assert tenants.delete(f"/v1/responses/{rid}", headers=B).status_code == 404
    cont = tenants.post("/v1/responses", json={**RESP, "previous_response_id": rid}, headers=B)
    err = openai_error(cont, 404)
    assert err["param"] == "previous_response_id"
    # A still has it, and can continue and delete it
    assert tenants.get(f"/v1/responses/{rid}", headers=A).json()["id"] == rid
    r2 = tenants.post("/v1/responses", json={**RESP, "previous_response_id": rid}, headers=A)
    assert r2.status_code == 200
    assert tenants.delete(f"/v1/responses/{rid}", headers=A).status_code == 200


def test_an_item_reference_reaches_only_the_tenants_own_items(tenants: TestClient) -> None:
    r = tenants.post("/v1/responses", json=RESP, headers=A)
    item_id = r.json()["output"][0]["id"]
    ref = {**RESP, "input": [{"type": "item_reference", "id": item_id},
                             {"role": "user", "content": "go on"}]}
    assert tenants.post("/v1/responses", json=ref, headers=A).status_code == 200
    assert tenants.post("/v1/responses", json=ref, headers=B).status_code == 400


def test_stats_and_dashboard_list_only_the_callers_sessions(tenants: TestClient) -> None:
    tenants.post("/v1/chat/completions", json=CHAT, headers={**A, "X-Session-Id": "session-alice-7"})
    tenants.post("/v1/chat/completions", json=CHAT, headers={**B, "X-Session-Id": "sb"})
    for path, pick in (("/v1/cache/stats", lambda d: d["sessions"]),
                       ("/v1/dashboard/data", lambda d: d["stats"]["sessions"])):
        seen_b = pick(tenants.get(path, headers=B).json())
        assert [(s["tenant"], s["session_id"]) for s in seen_b["by_session"]] == [("bob", "sb")]
        assert seen_b["tracked"] == 1
        assert "session-alice-7" not in json.dumps(tenants.get(path, headers=B).json())
        seen_a = pick(tenants.get(path, headers=A).json())
        assert [(s["tenant"], s["session_id"]) for s in seen_a["by_session"]] == [
            ("alice", "session-alice-7")]


BAD_SCHEMAS = ["not a schema", {"type": "string"}, {"type": "object", "properties": 5},
               {"type": "object", "properties": {"x": 3}},
               {"type": "object", "required": "x"}]


@pytest.mark.parametrize("schema", BAD_SCHEMAS)
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_an_invalid_tool_schema_is_a_400_in_every_api(client: TestClient, schema: Any,
                                                      choice: str) -> None:
    chat_tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    r = client.post("/v1/chat/completions",
                    json={**CHAT, "tools": [chat_tool], "tool_choice": choice})
    assert "parameters" in openai_error(r, 400)["message"]
    r = client.post("/v1/responses", json={**RESP, "tools": [
        {"type": "function", "name": "f", "parameters": schema}], "tool_choice": choice})
    assert "parameters" in openai_error(r, 400)["message"]
    a_choice = {"type": "auto"} if choice == "auto" else {"type": "any"}
    r = client.post("/v1/messages", json={**MSG, "tools": [
        {"name": "f", "input_schema": schema}], "tool_choice": a_choice})
    anthropic_error(r, 400)
    served(client)


def test_a_valid_tool_schema_is_served_in_every_api(client: TestClient) -> None:
    schema = {"type": "object", "properties": {"path": {"type": "string"}},
              "required": ["path"]}
    r = client.post("/v1/chat/completions", json={**CHAT, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": schema}}]})
    assert r.status_code == 200
    r = client.post("/v1/responses", json={**RESP, "tools": [
        {"type": "function", "name": "f", "parameters": schema}]})
    assert r.status_code == 200
    r = client.post("/v1/messages", json={**MSG, "tools": [{"name": "f", "input_schema": schema}]})
    assert r.status_code == 200


def test_a_10mb_prompt_is_refused_after_a_bounded_tokenization(tiny_llama_path: Path) -> None:
    """A real tokenizer: a 10 MB chat (far past the tiny model's context) is a 400
    context_length_exceeded after tokenizing (context + 1) x longest-token characters,
    and a small chat is served right after it."""
    from real_engine import make_cache, tiny_engine

    eng = tiny_engine(tiny_llama_path, make_cache())
    try:
        c = TestClient(create_app(eng, ServerConfig(max_body_bytes=16 * 1024**2)))
        seen: list[int] = []
        real = eng.templates.tokenizer.encode

        def counting(text: str, **kw: Any) -> Any:
            seen.append(len(text))
            return real(text, **kw)

        eng.templates.tokenizer = type("Counting", (), {
            "encode": staticmethod(counting),
            "__getattr__": lambda self, name: getattr(eng.tokenizer, name)})()
        huge = {**CHAT, "messages": [{"role": "user", "content": "word " * 2_000_000}]}
        err = openai_error(c.post("/v1/chat/completions", json=huge), 400)
        assert err["code"] == "context_length_exceeded"
        bound = (eng.context_length + 1) * eng.templates._longest_token_chars()
        # the template probes render a few short texts; the 10 MB one is cut at the bound
        assert max(seen) == seen[-1] == bound and bound < 1_000_000
        served(c)
        # 10,000 messages: past the window too, refused the same way
        many = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} of many"}
                for i in range(10_001)]
        err = openai_error(c.post("/v1/chat/completions", json={**CHAT, "messages": many}), 400)
        assert err["code"] == "context_length_exceeded"
        served(c)
    finally:
        eng.close()


def test_a_message_id_of_another_tenant_is_unknown_to_diagnostics(tenants: TestClient) -> None:
    """``diagnostics.previous_message_id`` names a turn of the caller's tenant only:
    another tenant's id is ``previous_message_not_found`` (never a prefix oracle)."""
    beta = {"anthropic-beta": "cache-diagnosis-2026-04-07"}
    first = tenants.post("/v1/messages", json=MSG, headers={**A, **beta}).json()
    ask = {**MSG, "diagnostics": {"previous_message_id": first["id"]}}
    theirs = tenants.post("/v1/messages", json=ask, headers={**B, **beta}).json()
    assert theirs["diagnostics"] == {
        "cache_miss_reason": {"type": "previous_message_not_found"}}
    mine = tenants.post("/v1/messages", json=ask, headers={**A, **beta}).json()
    assert mine["diagnostics"] != {
        "cache_miss_reason": {"type": "previous_message_not_found"}}
