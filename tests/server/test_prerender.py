"""Next-turn pre-render (server/prompts/prerender.py) on the fake engine: what is rendered, when
a background prefill is submitted (and when not), the bounds, cancellation by the
session's next request, and that the next turn then hits the pre-rendered prefix."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from promptcache.engine.api import GenerationResult, Usage
from promptcache.server import create_app
from promptcache.server.prompts.prerender import PreRenderer
from promptcache.serving_config import ServerConfig

THINK_REPLY = "<think>Let me see.</think>Hi there."
SESSION = {"X-Session-Id": "pre-1"}


def _client(engine: FakeEngine, **config: Any) -> Iterator[TestClient]:
    with TestClient(create_app(engine, ServerConfig(**config))) as client:
        yield client


@pytest.fixture
def think() -> FakeEngine:
    return FakeEngine(think=True, reply=THINK_REPLY)


@pytest.fixture
def client(think: FakeEngine) -> Iterator[TestClient]:
    yield from _client(think)


def prerenderer(client: TestClient) -> PreRenderer:
    pre: PreRenderer = client.app.state.pc_prerender  # type: ignore[attr-defined]
    return pre


def settle(client: TestClient) -> dict[str, Any]:
    pre = prerenderer(client)
    assert pre.wait_idle(timeout=30)
    return pre.snapshot()


def chat(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "default", "max_tokens": 200, "messages": messages}


def test_reasoning_dropped_from_history_is_prefilled_in_the_background(
        client: TestClient, think: FakeEngine) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    r = client.post("/v1/chat/completions", json=chat(msgs), headers=SESSION)
    body = r.json()["choices"][0]["message"]
    assert (body["reasoning_content"], body["content"]) == ("Let me see.", "Hi there.")
    stats = settle(client)
    assert (stats["scheduled"], stats["submitted"], stats["done"]) == (1, 1, 1)
    [bg] = think.background
    assert (bg.priority, bg.prefill_only, bg.session_id) == ("background", True, "pre-1")
    # the next turn as the client sends it: the reply without its reasoning
    nxt = msgs + [{"role": "assistant", "content": "Hi there."},
                  {"role": "user", "content": "and now?"}]
    r2 = client.post("/v1/chat/completions", json=chat(nxt), headers=SESSION)
    prompt = think.submitted[-1].prompt_tokens
    text = bytes(bg.prompt_tokens).decode()
    assert text.endswith("<|assistant|>Hi there.\n<|user|>")
    assert prompt[:len(bg.prompt_tokens)] == bg.prompt_tokens
    assert stats["suffix_tokens"] == len(bg.prompt_tokens) - text.index("Hi there.")
    # the whole pre-rendered prefix came from the cache
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(bg.prompt_tokens)
    # ... and was the session's latest chain until this turn (the first turn's before it)
    assert think.cache is not None
    assert think.cache.active[:2] == [("default", len(msgs_tokens(think)), "pre-1"),
                                      ("default", len(bg.prompt_tokens), "pre-1")]


def msgs_tokens(engine: FakeEngine) -> list[int]:
    """The first turn's prompt + output tokens."""
    first = engine.submitted[0]
    return list(first.prompt_tokens) + engine.tokenizer.encode(THINK_REPLY)


def test_nothing_to_do_when_the_stored_tokens_are_the_next_prefix() -> None:
    engine = FakeEngine(reply="Plain answer.")
    for client in _client(engine):
        client.post("/v1/chat/completions", json=chat([{"role": "user", "content": "hi"}]),
                    headers=SESSION)
        stats = settle(client)
        assert (stats["scheduled"], stats["not_needed"], stats["submitted"]) == (1, 1, 0)
        assert engine.background == []


def test_tool_calls_rendered_by_the_template() -> None:
    """The model writes a call its own way; the template renders it back another way."""
    engine = FakeEngine(reply='<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}'
                              "</tool_call>")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    for client in _client(engine):
        r = client.post("/v1/chat/completions",
                        json={**chat([{"role": "user", "content": "weather?"}]), "tools": tools},
                        headers=SESSION)
        [call] = r.json()["choices"][0]["message"]["tool_calls"]
        settle(client)
        [bg] = engine.background
        text = bytes(bg.prompt_tokens).decode()
        assert text.endswith('<|assistant|><tool_call>{"arguments": {"city": "Paris"}, '
                             '"name": "get_weather"}</tool_call>\n<|user|>')
        # the client's next request starts with exactly that prefix
        nxt = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
        client.post("/v1/chat/completions", json={**chat(nxt), "tools": tools}, headers=SESSION)
        prompt = engine.submitted[-1].prompt_tokens
        same = next(i for i, (a, b) in enumerate(zip(prompt, bg.prompt_tokens, strict=False))
                    if a != b)
        assert bytes(bg.prompt_tokens[same:]).decode() == "user|>"  # the next role differs


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_every_api_hands_over_its_reply(think: FakeEngine, client: TestClient, api: str
                                        ) -> None:
    if api == "messages":
        body = {"model": "default", "max_tokens": 64, "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}
        client.post("/v1/messages", json=body, headers=SESSION)
    else:
        client.post("/v1/responses", json={"model": "default", "input": "hi", "stream": True},
                    headers=SESSION)
    settle(client)
    [bg] = think.background
    assert bytes(bg.prompt_tokens).decode().endswith("<|assistant|>Hi there.\n<|user|>")


class HeldHandle:
    """A background request that runs until it is cancelled (a long pre-render)."""

    def __init__(self, request: Any) -> None:
        self.request = request
        self.cancelled = False
        self._stop = asyncio.Event()

    def cancel(self) -> None:  # called on the event loop (a new request of the session)
        self.cancelled = True
        self._stop.set()

    async def aevents(self) -> AsyncIterator[Any]:
        await self._stop.wait()
        yield GenerationResult([], "", "cancelled", Usage())


def test_bounds_and_cancellation(think: FakeEngine) -> None:
    held: list[HeldHandle] = []
    real_submit = think.submit

    def submit(request: Any) -> Any:
        if request.priority != "background":
            return real_submit(request)
        held.append(HeldHandle(request))
        return held[-1]

    think.submit = submit  # type: ignore[method-assign]
    for client in _client(think, prerender_max_pending=1):
        pre = prerenderer(client)
        msgs = [{"role": "user", "content": "hi"}]
        client.post("/v1/chat/completions", json=chat(msgs), headers=SESSION)
        assert pre.wait_idle(timeout=0.2) is False  # held: it never ends by itself
        assert pre.snapshot()["pending"] == 1 and len(held) == 1
        # another session: over max_pending (1), skipped and counted
        client.post("/v1/chat/completions", json=chat(msgs), headers={"X-Session-Id": "pre-2"})
        assert pre.snapshot()["skipped_busy"] == 1 and len(held) == 1
        # the first session's next request cancels its pending pre-render
        nxt = msgs + [{"role": "assistant", "content": "Hi there."},
                      {"role": "user", "content": "more"}]
        client.post("/v1/chat/completions", json=chat(nxt), headers=SESSION)
        assert held[0].cancelled is True
        # the worker runs in order: once a later preparation is done, so is the render
        # of that turn's own pre-render (submitted and held in turn)
        client.post("/v1/messages/count_tokens", json={"model": "default", "messages": msgs})
        assert len(held) == 2 and not held[1].cancelled
        snap = pre.snapshot()
        assert (snap["pending"], snap["submitted"], snap["cancelled"]) == (1, 2, 1)
        client.portal.call(held[1].cancel)  # type: ignore[union-attr]
        assert pre.wait_idle(timeout=30)


def test_switched_off(think: FakeEngine) -> None:
    for client in _client(think, prerender=False):
        client.post("/v1/chat/completions", json=chat([{"role": "user", "content": "hi"}]))
        assert prerenderer(client).snapshot()["scheduled"] == 0
        assert think.background == []
        stats = client.get("/v1/cache/stats").json()["prerender"]
        assert stats["enabled"] is False
