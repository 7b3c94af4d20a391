"""Replays of the requests Claude Code, Codex and OpenCode really sent (recorded by
tests/clients with ``--log-requests``, scrubbed, in tests/fixtures/traffic/): each gets a
200 with its API's event sequence, consistent usage and the client's session; with a
window the prompt does not fit, the documented 400. No Node needed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import sse_checks
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from promptcache.server import create_app
from promptcache.serving_config import EngineConfig, ServerConfig

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "traffic"
RECORDS = sorted(FIXTURES.glob("*/*.json"))
SESSION_HEADERS = {"claude_code": "x-claude-code-session-id", "codex": "session-id",
                   "opencode": "x-session-id"}
REPLY = "Hello from a replay."


def _load(path: Path) -> dict[str, Any]:
    rec: dict[str, Any] = json.loads(path.read_text())
    return rec


def _send(client: TestClient, rec: dict[str, Any], body: Any = None) -> Any:
    url = rec["path"] + (f"?{rec['query']}" if rec["query"] else "")
    headers = {k: v for k, v in rec["headers"].items() if k.lower() != "accept-encoding"}
    return client.request(rec["method"], url, json=rec["body"] if body is None else body,
                          headers=headers)


def test_every_client_is_recorded() -> None:
    clients = {p.parent.name for p in RECORDS}
    assert clients == set(SESSION_HEADERS), clients
    assert len(RECORDS) >= 6


@pytest.mark.parametrize("path", RECORDS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_replay(path: Path) -> None:
    rec = _load(path)
    engine = FakeEngine(context_length=1 << 20, reply=REPLY)
    client = TestClient(create_app(engine, ServerConfig()))
    r = _send(client, rec)
    assert r.status_code == 200, r.text
    req = engine.submitted[-1]
    prompt = len(req.prompt_tokens)
    session = rec["headers"][SESSION_HEADERS[path.parent.name]]
    assert req.session_id == session
    stream = rec["body"].get("stream", False)
    api = rec["path"]
    if api == "/v1/messages":
        assert stream
        got = sse_checks.anthropic_stream(r.text)
        u = got["usage"]
        assert u["input_tokens"] + u["cache_creation_input_tokens"] \
            + u["cache_read_input_tokens"] == prompt
        su = got["start_usage"]
        assert su["input_tokens"] + su["cache_creation_input_tokens"] \
            + su["cache_read_input_tokens"] == prompt
        assert [b["type"] for b in got["content"]] == ["text"]
        assert got["content"][0]["text"] == REPLY
        assert got["stop"] == {"stop_reason": "end_turn", "stop_sequence": None}
        # the mid-conversation system message kept its place (the fake renders any role)
        roles = [m["role"] for m in engine.rendered[-1][0]]
        assert roles.count("system") >= 2 and roles.index("user") < len(roles) - 1
    elif api == "/v1/responses":
        assert stream
        final = sse_checks.responses_stream(r.text)
        assert final["status"] == "completed"
        u = final["usage"]
        assert u["input_tokens"] == prompt
        assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
        assert [o["type"] for o in final["output"]] == ["message"]
        assert final["output"][0]["content"][0]["text"] == REPLY
        # Codex's namespace tool: its functions offered under qualified names; web_search
        # (a server-side tool) left out
        names = [t["function"]["name"] for t in engine.rendered[-1][1]]
        assert "multi_agent_v1__close_agent" in names and "web_search" not in names
        assert req.session_id == rec["body"]["prompt_cache_key"]
    else:
        assert api == "/v1/chat/completions" and stream
        got = sse_checks.chat_stream(r.text)
        assert got["content"] == REPLY and got["finish_reason"] == "stop"
        u = got["usage"]
        assert u["prompt_tokens"] == prompt
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


@pytest.mark.parametrize("path", RECORDS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_replay_on_a_small_window_gets_the_documented_400(path: Path) -> None:
    rec = _load(path)
    engine = FakeEngine(context_length=1024, reply=REPLY)
    client = TestClient(create_app(engine, ServerConfig()))
    r = _send(client, rec)
    prompt = len(engine.render_chat(*engine.rendered[-1]))
    assert prompt >= 1024
    assert r.status_code == 400
    if rec["path"] == "/v1/messages":
        assert r.json() == {"type": "error", "error": {
            "type": "invalid_request_error",
            "message": f"prompt is too long: {prompt} tokens > 1024 maximum"}}
    else:
        assert r.json() == {"error": {
            "message": f"This model's maximum context length is 1024 tokens. However, your "
                       f"messages resulted in {prompt} tokens. Please reduce the length of "
                       "the messages.",
            "type": "invalid_request_error", "param": "messages",
            "code": "context_length_exceeded"}}
    assert engine.submitted == []


def test_claude_code_default_max_tokens_is_clamped_to_the_window() -> None:
    """Claude Code asks for max_tokens 32000 whatever the window: clamped to the room
    left, and the reply that hits it ends with stop_reason max_tokens."""
    rec = _load(FIXTURES / "claude_code" / "01-v1_messages.json")
    body = {**rec["body"], "max_tokens": 32000}
    probe = FakeEngine(context_length=1 << 20)
    _send(TestClient(create_app(probe, ServerConfig())), rec)
    prompt = len(probe.submitted[-1].prompt_tokens)
    engine = FakeEngine(context_length=prompt + 50, reply="x" * 200)
    client = TestClient(create_app(engine, ServerConfig(),
                                   engine_config=EngineConfig(max_tokens_limit=32768)))
    r = _send(client, rec, body)
    assert r.status_code == 200, r.text
    assert engine.submitted[-1].sampling.max_tokens == 50
    got = sse_checks.anthropic_stream(r.text)
    assert got["stop"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert got["usage"]["output_tokens"] == 50
