"""``logprobs`` of /v1/completions and ``logit_bias`` on a real engine (tiny llama, greedy):
the completion's tokens and logprobs are the chat API's for the same prompt tokens; a
+100 bias makes every token the biased one, a -100 bias removes the greedy first token,
and a biased row verifies drafts through the bias (a pure function of the tokens),
its tokens those of decoding one at a time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from real_engine import tiny_engine

from promptcache.engine.engine import Engine
from promptcache.server import create_app
from promptcache.serving_config import ServerConfig

MESSAGES = [{"role": "user", "content": "Count from one to twenty, in words."}]


@pytest.fixture(scope="module")
def engine(tiny_llama_path: Path) -> Iterator[Engine]:
    eng = tiny_engine(tiny_llama_path, None, speculation="suffix", spec_max_draft=4,
                      spec_verify_cost=(1.0, 0.0))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def client(engine: Engine) -> TestClient:
    return TestClient(create_app(engine, ServerConfig(prerender=False)))


def _post(client: TestClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post(path, json={"model": "default", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_completion_logprobs_match_the_chat_logprobs(engine: Engine,
                                                     client: TestClient) -> None:
    chat = _post(client, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 6, "logprobs": True, "top_logprobs": 3})
    content = chat["choices"][0]["logprobs"]["content"]
    prompt = engine.render_chat(MESSAGES)
    comp = _post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 6,
                                             "logprobs": 3})
    choice = comp["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == chat["choices"][0]["message"]["content"]
    assert lp["tokens"] == [e["token"] for e in content]
    assert len(lp["tokens"]) == comp["usage"]["completion_tokens"] == 6
    assert lp["token_logprobs"] == pytest.approx([e["logprob"] for e in content], abs=1e-4)
    for mine, theirs in zip(lp["top_logprobs"], content, strict=True):
        want = {a["token"]: a["logprob"] for a in theirs["top_logprobs"]}
        want.setdefault(theirs["token"], theirs["logprob"])
        assert list(mine) == list(want) and len(want) in (3, 4)
        assert list(mine.values()) == pytest.approx(list(want.values()), abs=1e-4)
        # greedy: the chosen token is the most likely one
        assert mine[theirs["token"]] == max(mine.values())
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(6)]


def test_logit_bias_changes_the_greedy_tokens(engine: Engine, client: TestClient) -> None:
    spec = engine._ctx.speculator
    assert spec is not None
    plain = _post(client, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 5, "logprobs": True})
    first = plain["choices"][0]["logprobs"]["content"][0]["token"]
    target = engine.encode_prompt(" hello")[-1]
    word = str(engine.tokenizer.decode([target]))
    # every draft would be the biased token: a row that speculated would verify them
    spec.source = lambda r, k: [target] * k
    before = client.get("/v1/cache/stats").json()["engine"]["spec_verifies"]
    try:
        up = _post(client, "/v1/chat/completions", {
            "messages": MESSAGES, "max_tokens": 11, "logprobs": True,
            "logit_bias": {str(target): 100}})
        assert [e["token"] for e in up["choices"][0]["logprobs"]["content"]] == [word] * 11
        up = _post(client, "/v1/completions", {
            "prompt": "Once upon a time", "max_tokens": 11, "logprobs": 0,
            "logit_bias": {str(target): 100}})
        assert up["choices"][0]["logprobs"]["tokens"] == [word] * 11
        assert up["choices"][0]["text"].split() == ["hello"] * 11
        assert client.get("/v1/cache/stats").json()["engine"]["spec_verifies"] > before
    finally:
        spec.source = None
    first_id = next(t for t in range(engine.vocab_size)
                    if engine.tokenizer.decode([t]) == first)
    down = _post(client, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 5, "logprobs": True,
        "logit_bias": {str(first_id): -100}})
    assert down["choices"][0]["logprobs"]["content"][0]["token"] != first
    # a normal request beside them answers as before
    again = _post(client, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 5, "logprobs": True})
    assert again["choices"][0]["message"] == plain["choices"][0]["message"]
