"""Cache breakpoints, prompt_cache_key and active sessions through the server on a real
tiny engine: the blocks a client asked to keep survive an eviction storm of other
requests (exact block hashes) and go after their ttl (controllable clock)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from real_engine import Clock, make_cache, tiny_engine

from promptcache.hashing import BlockHash
from promptcache.server import create_app
from promptcache.serving_config import ServerConfig

BS = 8
SYSTEM = ("You are a careful agent. You read the files before you change them, you keep the "
          "style of the code around you, and you report what you did plainly.")


class Served:
    def __init__(self, path: Path, **kw: Any) -> None:
        self.clock = Clock()
        self.cache = make_cache(block_size=BS, clock=self.clock, **kw)
        self.engine = tiny_engine(path, self.cache, block_size=BS, chunk=4 * BS)
        self.client = TestClient(create_app(self.engine, ServerConfig(prerender=False)))

    def messages(self, system: Any, user: str, headers: dict[str, str] | None = None
                 ) -> dict[str, Any]:
        r = self.client.post("/v1/messages", headers=headers or {}, json={
            "model": "default", "max_tokens": 2, "system": system,
            "messages": [{"role": "user", "content": user}]})
        assert r.status_code == 200, r.text
        self.sync()
        usage: dict[str, Any] = r.json()["usage"]
        return usage

    def sync(self) -> None:
        """The worker thread runs in order: a later preparation done, so is every claim
        queued before it."""
        r = self.client.post("/v1/messages/count_tokens", json={
            "model": "default", "messages": [{"role": "user", "content": "sync"}]})
        assert r.status_code == 200

    def limit_to(self, blocks: int) -> int:
        """Shrink the RAM budget to ``blocks`` full blocks; returns a block's bytes."""
        sizes = {b.nbytes for b in self.cache.pool.blocks() if b.num_tokens == BS}
        assert len(sizes) == 1
        nbytes = sizes.pop()
        self.cache.pool.budget_bytes = blocks * nbytes
        self.cache.evict(0)
        return nbytes

    def storm(self, first: int, count: int) -> None:
        for i in range(first, first + count):
            self.messages(f"Request {i}: summarise chapter {i} of the long manual on "
                          f"subject number {i * 7}, with care.", f"go {i}")

    def held(self) -> set[BlockHash]:
        return {b.block_hash for b in self.cache.pool.blocks() if b.block_hash is not None}

    def close(self) -> None:
        self.engine.close()


@pytest.fixture
def served(tiny_llama_path: Path) -> Iterator[Served]:
    s = Served(tiny_llama_path)
    yield s
    s.close()


def test_breakpoint_survives_a_storm_and_expires_after_its_ttl(served: Served) -> None:
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    served.messages(system, "hello there")
    [(hashes, until)] = served.cache.levels.protections().values()
    assert until == served.clock.t + 300.0
    prompt_blocks = {b.block_hash for b in served.cache.pool.blocks()}
    assert set(hashes) < prompt_blocks  # the system prompt's blocks, not the user turn's
    served.limit_to(40)
    served.clock.advance(299.0)
    served.storm(0, 25)  # far more than 40 blocks of other prompts
    held = served.held()
    assert set(hashes) <= held
    assert not (prompt_blocks - set(hashes)) & held  # the unmarked tail went
    usage = served.messages(system, "another question")
    assert usage["cache_read_input_tokens"] >= (len(hashes) - 1) * BS
    # that request renewed the breakpoint (same prefix): 300 s from now
    [(_, until)] = served.cache.levels.protections().values()
    assert until == served.clock.t + 300.0
    served.clock.advance(300.0)
    served.storm(100, 25)
    assert not set(hashes) & served.held()
    assert served.cache.levels_snapshot()["protections_expired"] == 1
    stats = served.client.get("/v1/cache/stats").json()["cache"]["levels"]
    assert (stats["protections"], stats["protected_bytes"]) == (0, 0)


def test_subagents_keep_their_tails_while_an_idle_conversation_goes(served: Served) -> None:
    session = {"X-Claude-Code-Session-Id": "s1"}
    chains = {}
    for agent in ("a1", "a2", "a3"):
        headers = {**session, "x-claude-code-agent-id": agent,
                   "x-claude-code-parent-agent-id": "main"}
        served.messages(SYSTEM, f"Subagent {agent}: look for the config loader.", headers)
        [(hashes, _)] = [v for k, v in served.cache.levels.active_sessions().items()
                         if k[3] == f"s1\x1f{agent}"]
        chains[agent] = hashes
    shared = [h for h in chains["a1"] if h in chains["a2"] and h in chains["a3"]]
    assert len(shared) >= 3  # the system prompt
    tails = {a: [h for h in c if h not in shared] for a, c in chains.items()}
    assert all(tails.values())
    served.limit_to(60)
    served.storm(0, 30)  # no session: idle chains
    held = served.held()
    assert set(shared) <= held
    for agent, tail in tails.items():
        assert set(tail) <= held, agent
    served.clock.advance(600.0)  # the subagents are quiet now: their tails go too
    served.storm(100, 30)
    assert not {h for t in tails.values() for h in t} & served.held()


def test_prompt_cache_key_protects_its_latest_chain_only(served: Served) -> None:
    def chat(user: str) -> None:
        r = served.client.post("/v1/chat/completions", json={
            "model": "default", "max_tokens": 2, "prompt_cache_key": "codex-1",
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": user}]})
        assert r.status_code == 200, r.text
        served.sync()

    chat("first task")
    [(first, _)] = [v for k, v in served.cache.levels.protections().items() if k[0] == "key"]
    chat("second task, a new one")
    [(second, until)] = [v for k, v in served.cache.levels.protections().items()
                         if k[0] == "key"]
    assert until == served.clock.t + 600.0
    assert first != second
    served.limit_to(40)
    served.storm(0, 25)
    held = served.held()
    assert set(second) <= held
    assert set(first) - set(second) and not (set(first) - set(second)) & held
