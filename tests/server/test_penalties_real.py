"""Repetition, presence and frequency penalties on a real engine (tiny llama, greedy):
the tokens are mlx-lm's own ``generate_step`` with ``make_logits_processors`` (the
end-of-turn tokens spared) over the same prompt tokens, with or without speculation (a penalized row verifies drafts position
by position); the server's ``--repetition-penalty`` applies to a request that gives none
(Anthropic's API has no such field); out-of-range values are a 400 naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from fastapi.testclient import TestClient
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors
from real_engine import tiny_engine

from promptcache.engine.engine import Engine
from promptcache.engine.formats import constrained
from promptcache.server import create_app
from promptcache.serving_config import EngineConfig, ServerConfig

MESSAGES = [{"role": "user", "content": "hi"}]
N = 12


@pytest.fixture(scope="module")
def engine(tiny_llama_path: Path) -> Iterator[Engine]:
    eng = tiny_engine(tiny_llama_path, None, speculation="suffix", spec_max_draft=4,
                      spec_verify_cost=(1.0, 0.0))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def client(engine: Engine) -> TestClient:
    return TestClient(create_app(engine, ServerConfig(prerender=False)))


def _tokens(client: TestClient, body: dict[str, Any], path: str = "/v1/chat/completions"
            ) -> list[str]:
    r = client.post(path, json={"model": "default", "temperature": 0, "max_tokens": N,
                                "messages": MESSAGES, "logprobs": True, **body})
    assert r.status_code == 200, r.text
    return [e["token"] for e in r.json()["choices"][0]["logprobs"]["content"]]


def _reference(engine: Engine, **penalties: Any) -> list[int]:
    prompt = engine.render_chat(MESSAGES)
    # the end-of-turn tokens spared, as the engine does (``constrained.sparing``)
    procs = [constrained.sparing(p, engine._ctx.eos_token_ids)
             for p in make_logits_processors(**penalties)]
    out: list[int] = []
    for t, _ in generate_step(mx.array(prompt), engine._ctx.model, logits_processors=procs,
                              max_tokens=N):
        out.append(int(t))
    return out


def _words(engine: Engine, ids: list[int]) -> list[str]:
    return [str(engine.tokenizer.decode([t])) for t in ids]


@pytest.mark.parametrize("body,penalties", [
    ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
    ({"repetition_penalty": 6.0, "repetition_context_size": 3},
     {"repetition_penalty": 6.0, "repetition_context_size": 3}),
    ({"presence_penalty": 2.0}, {"presence_penalty": 2.0}),
    ({"frequency_penalty": 1.5}, {"frequency_penalty": 1.5}),
])
def test_penalties_are_mlx_lm_s_with_and_without_speculation(
        engine: Engine, client: TestClient, body: dict[str, Any],
        penalties: dict[str, Any]) -> None:
    want = _reference(engine, **penalties)
    assert want != _reference(engine)  # the penalty changes this model's greedy tokens
    assert _tokens(client, body) == _words(engine, want)
    spec = engine._ctx.speculator
    assert spec is not None
    # drafts that are the reference's own next tokens: every verify accepts some
    spec.source = lambda r, k: want[len(r.output): len(r.output) + k]
    before = client.get("/v1/cache/stats").json()["engine"]
    try:
        assert _tokens(client, body) == _words(engine, want)
        # and drafts that are all wrong: rejected, the tokens the same
        spec.source = lambda r, k: [want[0]] * k
        assert _tokens(client, body) == _words(engine, want)
    finally:
        spec.source = None
    after = client.get("/v1/cache/stats").json()["engine"]
    assert after["spec_verifies"] > before["spec_verifies"]
    assert after["spec_accepted"] > before["spec_accepted"]


def test_the_server_default_applies_to_a_request_that_gives_none(
        tiny_llama_path: Path) -> None:
    eng = tiny_engine(tiny_llama_path, None, speculation="off")
    try:
        cfg = EngineConfig(prefill_chunk_tokens=16, snapshot_every_blocks=1,
                           max_tokens_limit=4096, default_max_tokens=8,
                           repetition_penalty=1.8, repetition_context_size=4)
        client = TestClient(create_app(eng, ServerConfig(prerender=False), engine_config=cfg))
        want = _words(eng, _reference(eng, repetition_penalty=1.8, repetition_context_size=4))
        assert _tokens(client, {}) == want
        # a request's own value wins (1.0: off)
        assert _tokens(client, {"repetition_penalty": 1.0}) == _words(eng, _reference(eng))
        chat = client.post("/v1/chat/completions", json={
            "model": "default", "max_tokens": N, "temperature": 0, "messages": MESSAGES})
        r = client.post("/v1/messages", json={"model": "default", "max_tokens": N,
                                              "temperature": 0, "messages": MESSAGES})
        assert r.status_code == 200, r.text
        assert r.json()["content"][0]["text"] == chat.json()["choices"][0]["message"]["content"]
    finally:
        eng.close()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
@pytest.mark.parametrize("field,value", [
    ("repetition_penalty", 0), ("repetition_penalty", 11), ("presence_penalty", 2.5),
    ("frequency_penalty", -3), ("repetition_context_size", 0),
])
def test_out_of_range_is_a_400_naming_the_field(client: TestClient, path: str, field: str,
                                                value: float) -> None:
    body: dict[str, Any] = {"model": "default", field: value}
    if path == "/v1/completions":
        body["prompt"] = "hi"
    elif path == "/v1/responses":
        body["input"] = "hi"
    else:
        body["messages"] = MESSAGES
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]
