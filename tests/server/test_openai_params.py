"""OpenAI parameters that used to be ignored (issue 42): /v1/completions ``logprobs`` in
the legacy shape (0..5), ``logit_bias`` (checked against the vocabulary, passed to the
engine), ``best_of`` (only 1). Each refusal is a 400 in OpenAI's error shape naming the
parameter, nothing reaches the engine, and a normal request beside it still answers.
On the fake engine: token ``t``'s logprob is ``-(t % 7) / 10``, its j-th alternative
``(t + j) % 256`` with ``-((t + j) % 7) / 10 - j``; the reply is "Hello world!"."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
COMP = {"model": "default", "prompt": "Hi", "max_tokens": 3}


def openai_error(r: Any, param: str, message: str) -> None:
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"message": message, "type": "invalid_request_error",
                                  "param": param, "code": None}}


def served(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hel"
    r = client.post("/v1/completions", json=COMP)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hel"


def test_completion_logprobs_in_the_legacy_shape(engine: FakeEngine,
                                                 client: TestClient) -> None:
    r = client.post("/v1/completions", json={**COMP, "logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert engine.submitted[-1].sampling.logprobs == 2
    assert choice["text"] == "Hel"
    assert choice["logprobs"] == {
        "tokens": ["H", "e", "l"], "token_logprobs": [-0.2, -0.3, -0.3],
        "top_logprobs": [{"H": -0.2, "I": -1.3}, {"e": -0.3, "f": -1.4},
                         {"l": -0.3, "m": -1.4}],
        "text_offset": [0, 1, 2]}
    # 0 alternatives: the chosen token only
    r = client.post("/v1/completions", json={**COMP, "logprobs": 0})
    assert r.json()["choices"][0]["logprobs"]["top_logprobs"] == [
        {"H": -0.2}, {"e": -0.3}, {"l": -0.3}]
    # streamed: the same entries, split over the chunks, offsets running on
    lines = [ln[6:] for ln in client.post(
        "/v1/completions", json={**COMP, "logprobs": 2, "stream": True}).text.splitlines()
        if ln.startswith("data: ") and ln != "data: [DONE]"]
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                    "text_offset": []}
    for line in lines:
        lp = json.loads(line)["choices"][0]["logprobs"]
        for key in merged if lp else ():
            merged[key] += lp[key]
    assert merged == choice["logprobs"]
    # without logprobs: null, as before
    assert client.post("/v1/completions", json=COMP).json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("value,message", [
    (6, "logprobs must be an integer in [0, 5], got 6"),
    (100000, "logprobs must be an integer in [0, 5], got 100000"),
    (-1, "logprobs must be an integer in [0, 5], got -1"),
    (True, "logprobs must be an integer in [0, 5], got True"),
    ("3", "logprobs must be an integer in [0, 5], got '3'"),
])
def test_completion_logprobs_out_of_range_are_400(engine: FakeEngine, client: TestClient,
                                                  value: Any, message: str) -> None:
    openai_error(client.post("/v1/completions", json={**COMP, "logprobs": value}),
                 "logprobs", message)
    assert engine.submitted == []
    served(client)


def test_completion_logprobs_with_echo_is_400(engine: FakeEngine, client: TestClient) -> None:
    openai_error(client.post("/v1/completions", json={**COMP, "logprobs": 1, "echo": True}),
                 "logprobs", "logprobs with echo is not supported (the prompt's logprobs "
                             "are not computed)")
    assert engine.submitted == []
    served(client)


@pytest.mark.parametrize("value", [10**9, 2, 0, True])
def test_best_of_other_than_one_is_400(engine: FakeEngine, client: TestClient,
                                       value: Any) -> None:
    openai_error(client.post("/v1/completions", json={**COMP, "best_of": value}),
                 "best_of", f"only best_of=1 is supported, got {value!r}")
    assert engine.submitted == []
    r = client.post("/v1/completions", json={**COMP, "best_of": 1})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hel"
    served(client)


@pytest.mark.parametrize("bias,message", [
    ({"256": 5}, "logit_bias token id 256 is outside the vocabulary (size 256)"),
    ({"100000000": 1}, "logit_bias token id 100000000 is outside the vocabulary (size 256)"),
    ({"-1": 1}, "logit_bias keys must be token ids, got '-1'"),
    ({"abc": 1}, "logit_bias keys must be token ids, got 'abc'"),
    ({"72": 101}, "logit_bias values must be numbers in [-100, 100], got 101 for token 72"),
    ({"72": -100.5}, "logit_bias values must be numbers in [-100, 100], got -100.5 for token 72"),
    ({"72": "5"}, "logit_bias values must be numbers in [-100, 100], got '5' for token 72"),
    ([72], "logit_bias must be an object mapping token ids to biases"),
])
@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT),
                                       ("/v1/completions", COMP)])
def test_invalid_logit_bias_is_400(engine: FakeEngine, client: TestClient, path: str,
                                   body: dict[str, Any], bias: Any, message: str) -> None:
    openai_error(client.post(path, json={**body, "logit_bias": bias}), "logit_bias", message)
    assert engine.submitted == []
    served(client)


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT),
                                       ("/v1/completions", COMP)])
def test_logit_bias_reaches_the_engine(engine: FakeEngine, client: TestClient, path: str,
                                       body: dict[str, Any]) -> None:
    r = client.post(path, json={**body, "logit_bias": {"255": -100, "72": 5.5, "0": 100}})
    assert r.status_code == 200, r.text
    assert engine.submitted[-1].sampling.logit_bias == ((0, 100.0), (72, 5.5), (255, -100.0))
    client.post(path, json=body)
    assert engine.submitted[-1].sampling.logit_bias == ()
    served(client)
