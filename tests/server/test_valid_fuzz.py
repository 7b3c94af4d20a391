"""Generated *valid* generation bodies (Hypothesis) for chat, Messages and Responses:
every one is served (200, streamed or not), with every sampling field at any value of
its valid range, tools with valid schemas, several turns, text parts. Schemathesis
(test_server_fuzz.py) mostly reaches the validators; this reaches the engine path."""

from __future__ import annotations

from typing import Any

from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from promptcache.server import create_app
from promptcache.serving_config import ServerConfig

ENGINE = FakeEngine(reply="Sure, done.")
CLIENT = TestClient(create_app(ENGINE, ServerConfig(prerender=False)))
SETTINGS = settings(max_examples=40, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))

text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1,
               max_size=40)
schema = st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(
    st.from_regex(r"[a-z]{1,8}", fullmatch=True),
    st.sampled_from([{"type": "string"}, {"type": "integer"}, {"type": "object"},
                     {"type": ["string", "null"]}, {"type": "array", "items": {}}]),
    max_size=3)})
names = st.from_regex(r"[a-z][a-z_]{0,10}", fullmatch=True)
seed = st.one_of(st.none(), st.integers(0, 2**64 - 1))
temperature = st.one_of(st.none(), st.floats(0, 2))
top_p = st.one_of(st.none(), st.floats(0.01, 1))
max_tokens = st.integers(1, 64)


def turns(user: st.SearchStrategy[Any], assistant: st.SearchStrategy[Any]
          ) -> st.SearchStrategy[list[dict[str, Any]]]:
    pair = st.tuples(user, assistant).map(
        lambda p: [{"role": "user", "content": p[0]}, {"role": "assistant", "content": p[1]}])
    return st.tuples(st.lists(pair, max_size=3), user).map(
        lambda t: [m for p in t[0] for m in p] + [{"role": "user", "content": t[1]}])


parts = st.lists(text.map(lambda s: {"type": "text", "text": s}), min_size=1, max_size=3)


@st.composite
def chat_body(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "default", "max_tokens": draw(max_tokens),
                            "messages": draw(turns(st.one_of(text, parts), text)),
                            "stream": draw(st.booleans())}
    if draw(st.booleans()):
        body["messages"].insert(0, {"role": "system", "content": draw(text)})
    for key, strat in (("seed", seed), ("temperature", temperature), ("top_p", top_p)):
        value = draw(strat)
        if value is not None:
            body[key] = value
    if draw(st.booleans()):
        tool_names = draw(st.lists(names, min_size=1, max_size=3, unique=True))
        body["tools"] = [{"type": "function", "function": {
            "name": n, "description": draw(text), "parameters": draw(schema)}}
            for n in tool_names]
        body["tool_choice"] = draw(st.sampled_from(["auto", "none"]))
    if draw(st.booleans()):
        body["logprobs"] = True
        body["top_logprobs"] = draw(st.integers(0, 20))
    return body


@st.composite
def messages_body(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "default", "max_tokens": draw(max_tokens),
                            "messages": draw(turns(st.one_of(text, parts), text)),
                            "stream": draw(st.booleans())}
    if draw(st.booleans()):
        body["system"] = draw(st.one_of(text, parts))
    for key, strat in (("temperature", st.floats(0, 1)), ("top_p", top_p),
                       ("top_k", st.integers(0, 100))):
        if draw(st.booleans()):
            body[key] = draw(strat)
    if draw(st.booleans()):
        body["stop_sequences"] = draw(st.lists(text, max_size=3))
    if draw(st.booleans()):
        tool_names = draw(st.lists(names, min_size=1, max_size=3, unique=True))
        body["tools"] = [{"name": n, "description": draw(text), "input_schema": draw(schema)}
                         for n in tool_names]
    return body


@st.composite
def responses_body(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "default", "max_output_tokens": draw(max_tokens),
                            "stream": draw(st.booleans())}
    if draw(st.booleans()):
        body["input"] = draw(text)
    else:
        body["input"] = draw(turns(text, text))
    if draw(st.booleans()):
        body["instructions"] = draw(text)
    for key, strat in (("temperature", temperature), ("top_p", top_p)):
        value = draw(strat)
        if value is not None:
            body[key] = value
    if draw(st.booleans()):
        tool_names = draw(st.lists(names, min_size=1, max_size=3, unique=True))
        body["tools"] = [{"type": "function", "name": n, "parameters": draw(schema)}
                         for n in tool_names]
    return body


def ok(path: str, body: dict[str, Any]) -> None:
    r = CLIENT.post(path, json=body)
    assert r.status_code == 200, (path, body, r.text)
    if body.get("stream"):
        assert r.text.strip(), (path, body)


@SETTINGS
@given(chat_body())
def test_valid_chat_bodies_are_served(body: dict[str, Any]) -> None:
    ok("/v1/chat/completions", body)


@SETTINGS
@given(messages_body())
def test_valid_messages_bodies_are_served(body: dict[str, Any]) -> None:
    ok("/v1/messages", body)


@SETTINGS
@given(responses_body())
def test_valid_responses_bodies_are_served(body: dict[str, Any]) -> None:
    ok("/v1/responses", body)
