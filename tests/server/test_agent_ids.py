"""Claude Code's subagent id end to end: a real Engine (tiny llama) and PromptCache
behind the app get Messages requests shaped as Claude Code sends them (the recorded
fixture's headers and body fields, trimmed to the tiny model's window), with
``x-claude-code-agent-id`` / ``x-claude-code-parent-agent-id`` as on its subagent
requests. The agent is recorded on the blocks each request stores (next to the
session) and counted per session and agent in ``GET /v1/cache/stats``; the bounds of
those counts (sessions, agents per session) hold exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from promptcache.cache import PromptCache
from promptcache.config import CacheConfig
from promptcache.engine.engine import Engine
from promptcache.engine.payload.payload import MLXPayloadAdapter
from promptcache.server import create_app
from promptcache.server.api.auth import Scope
from promptcache.server.ops.session_stats import SessionStats
from promptcache.serving_config import EngineConfig, ServerConfig

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "traffic" / "claude_code"
SESSION = "759c5563-53c4-4b0b-b78f-e150f51b67f8"
MAIN = "a1b2c3d4-main"


def _recorded() -> dict[str, Any]:
    rec: dict[str, Any] = json.loads((FIXTURE / "01-v1_messages.json").read_text())
    return rec


def _claude_request(agent: str | None, task: str) -> tuple[dict[str, str], dict[str, Any]]:
    """The recorded first Claude Code request, its headers as sent (session header
    included), the subagent headers added; the body's system blocks and messages
    trimmed to fit a 4096-token window, the tools left out, non-streaming."""
    rec = _recorded()
    headers = {k: v for k, v in rec["headers"].items()
               if k not in ("connection", "accept-encoding", "content-length")}
    assert headers["x-claude-code-session-id"] == SESSION
    if agent is not None:
        headers["x-claude-code-agent-id"] = agent
        headers["x-claude-code-parent-agent-id"] = MAIN
    body = dict(rec["body"])
    body.pop("tools", None)
    body["stream"] = False
    body["max_tokens"] = 4
    body["system"] = [{**b, "text": b["text"][:300]} for b in body["system"][:3]]
    first, mid_system = body["messages"][0], body["messages"][1]
    assert mid_system["role"] == "system"
    body["messages"] = [
        {"role": "user", "content": [{"type": "text", "text": first["content"][0]["text"][:200]},
                                     {"type": "text", "text": task,
                                      "cache_control": {"type": "ephemeral"}}]},
        {"role": "system", "content": mid_system["content"][:200]},
    ]
    return headers, body


@pytest.fixture(scope="module")
def served(tiny_llama_path: Path):  # type: ignore[no-untyped-def]
    cc = CacheConfig(block_size=16, ram_budget_bytes=64 * 1024**2)
    cache = PromptCache(cc, adapter=MLXPayloadAdapter())
    with Engine.load(tiny_llama_path, EngineConfig(prefill_chunk_tokens=64), cc,
                     cache=cache) as eng:
        yield eng, TestClient(create_app(eng, ServerConfig()))


def _send(client: TestClient, agent: str | None, task: str) -> dict[str, int]:
    headers, body = _claude_request(agent, task)
    r = client.post("/v1/messages?beta=true", json=body, headers=headers)
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    prompt = u["input_tokens"] + u["cache_creation_input_tokens"] + u["cache_read_input_tokens"]
    return {"prompt_tokens": prompt, "cached_tokens": u["cache_read_input_tokens"]}


def test_subagent_ids_are_recorded_on_blocks_and_in_stats(served) -> None:  # type: ignore[no-untyped-def]
    eng, client = served
    main = _send(client, None, "Find the tests.")
    a1 = _send(client, "agent-explore-1", "Search the repository for the cache tiers.")
    b1 = _send(client, "agent-plan-2", "Plan the change to the stats.")
    a2 = _send(client, "agent-explore-1", "Search the repository for the cache tiers.")
    # the subagents share the session's system prompt: later requests restore it
    assert b1["cached_tokens"] > 0 and a2["cached_tokens"] > 0

    blocks = eng.cache.pool.blocks()
    assert blocks and all(b.sessions == (SESSION,) for b in blocks)
    assert {b.agents for b in blocks} == {(), ("agent-explore-1",), ("agent-plan-2",)}
    for agent, first in (("agent-explore-1", a1), ("agent-plan-2", b1)):
        # each subagent's blocks: one chain from where it left the shared prefix (the
        # main agent's blocks, no agent) to past its prompt (its reply's tokens)
        mine = sorted((b for b in blocks if b.agents == (agent,)), key=lambda b: b.start)
        assert all(x.end == y.start for x, y in zip(mine, mine[1:], strict=False))
        assert mine[0].start <= first["cached_tokens"] < mine[0].end
        assert mine[-1].end > first["prompt_tokens"]
        shared = [b for b in blocks if b.end <= mine[0].start]
        assert shared and all(b.agents == () for b in shared)

    stats = client.get("/v1/cache/stats").json()["sessions"]
    total = [main, a1, b1, a2]

    def summed(rows: list[dict[str, int]]) -> dict[str, int]:
        return {"requests": len(rows),
                "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
                "cached_tokens": sum(r["cached_tokens"] for r in rows)}

    assert stats == {
        "tracked": 1, "max_sessions": 256, "max_agents": 32, "evicted_sessions": 0,
        "by_session": [{
            "tenant": "default", "session_id": SESSION, **summed(total),
            "agents": [
                {"agent_id": "agent-explore-1", "parent_agent_id": MAIN, **summed([a1, a2])},
                {"agent_id": "agent-plan-2", "parent_agent_id": MAIN, **summed([b1])},
            ],
            "other_agents": {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0},
        }],
    }


def test_session_stats_bounds() -> None:
    st = SessionStats(max_sessions=2, max_agents=1)
    st.record(Scope(session_id="s1", agent_id="a", parent_agent_id="p"), 10, 4)
    st.record(Scope(session_id="s1", agent_id="b"), 20, 5)  # past max_agents
    st.record(Scope(session_id="s1"), 1, 0)
    st.record(Scope(tenant="t2", session_id="s1"), 7, 7)  # another tenant's s1
    st.record(Scope(session_id="s1", agent_id="a"), 3, 3)  # s1 active again
    st.record(Scope(session_id="s2"), 5, 0)  # evicts t2/s1, the least recently active
    st.record(Scope(), 100, 100)  # no session: not counted
    zero = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0}
    assert st.snapshot() == {
        "tracked": 2, "max_sessions": 2, "max_agents": 1, "evicted_sessions": 1,
        "by_session": [
            {"tenant": "default", "session_id": "s2", "requests": 1, "prompt_tokens": 5,
             "cached_tokens": 0, "agents": [], "other_agents": zero},
            {"tenant": "default", "session_id": "s1", "requests": 4, "prompt_tokens": 34,
             "cached_tokens": 12,
             "agents": [{"agent_id": "a", "parent_agent_id": "p", "requests": 2,
                         "prompt_tokens": 13, "cached_tokens": 7}],
             "other_agents": {"requests": 1, "prompt_tokens": 20, "cached_tokens": 5}},
        ],
    }
    with pytest.raises(ValueError):
        SessionStats(max_sessions=0)
