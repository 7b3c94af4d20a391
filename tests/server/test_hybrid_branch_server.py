"""Hybrid (SSM) snapshots at message starts through the server (issue 22, item 4): the
message starts the server renders reach the engine, so a retry of the last user message
with other words restores exactly up to that message's start (as the probe renders it),
and its answer equals one computed without the cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from real_engine import make_cache, tiny_engine

from promptcache.server import create_app
from promptcache.serving_config import ServerConfig

BS = 8
HISTORY = [{"role": "system", "content": "You are a terse assistant for shell questions."},
           {"role": "user", "content": "How do I list the files of a folder by size?"},
           {"role": "assistant", "content": "Use ls -lS in that folder; add -h for sizes."}]


def body(last: str) -> dict[str, Any]:
    return {"model": "default", "max_tokens": 4, "temperature": 0,
            "messages": [*HISTORY, {"role": "user", "content": last}]}


class Served:
    def __init__(self, path: Path) -> None:
        self.cache = make_cache(block_size=BS)
        # regular snapshots far apart (every 64 blocks): only message starts help here
        self.engine = tiny_engine(path, self.cache, block_size=BS, chunk=2 * BS,
                                  snapshot_every_blocks=64)
        self.client = TestClient(create_app(self.engine, ServerConfig(prerender=False)))

    def chat(self, b: dict[str, Any]) -> dict[str, Any]:
        r = self.client.post("/v1/chat/completions", json=b)
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    def rendered(self, b: dict[str, Any]) -> tuple[list[int], list[int]]:
        """(tokens, message starts) as the server renders the body (the probe)."""
        r = self.client.post("/v1/cache/probe?tokens=true&api=chat", json=b)
        assert r.status_code == 200, r.text
        got = r.json()
        return list(got["tokens"]), list(got["message_starts"])

    def close(self) -> None:
        self.engine.close()


@pytest.fixture
def served(tiny_hybrid_path: Path) -> Iterator[Served]:
    s = Served(tiny_hybrid_path)
    yield s
    s.close()


def test_retry_of_the_last_user_message_restores_to_its_start(served: Served) -> None:
    first = served.chat(body("And only the ten largest ones, please?"))
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    engine = served.engine.engine_stats()
    assert engine["message_snapshots"] == 3  # at the starts of messages 1, 2 and 3
    assert engine["bytes_per_snapshot"] > 0
    assert engine["snapshot_bytes"] == engine["snapshots"] * engine["bytes_per_snapshot"]
    retry = body("What about hidden files too?")
    tokens, starts = served.rendered(retry)
    assert len(starts) == 4
    assert starts == served.rendered(body("And only the ten largest ones, please?"))[1]
    got = served.chat(retry)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == starts[-1]
    plain = served.engine.generate(tokens, max_tokens=4, use_cache=False)
    assert got["choices"][0]["message"]["content"] == plain.text
