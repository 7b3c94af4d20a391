"""The server on the real default model (SmolLM2-135M-Instruct), in process: its template
drops ``tools``, so they go into the system turn (count_tokens grows by their size) and
the model sees a tool call and its result; a system turn mid-conversation is rendered
where it stands; an assistant prefill is left open; a forced call (parallel calls allowed)
cut by max_tokens leaks no ``<tool_call>`` markup."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import pytest
import sse_checks
from fastapi.testclient import TestClient

from promptcache.cli.wiring import build_cache
from promptcache.config import CacheConfig
from promptcache.engine.engine import Engine
from promptcache.server import create_app
from promptcache.server.prompts.prompt import tools_text
from promptcache.serving_config import EngineConfig, ServerConfig

pytestmark = pytest.mark.slow

TOOL = {"name": "get_weather", "description": "Get the current weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}


def spy_submits(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The requests ``engine.submit`` is given from now on (it still runs them)."""
    submitted: list[Any] = []
    submit = engine.submit

    def spy(req: Any) -> Any:
        submitted.append(req)
        return submit(req)

    monkeypatch.setattr(engine, "submit", spy)
    return submitted


# speculation's gate from a fixed cost, not measured at each start (seconds on this model)
PINNED = EngineConfig(spec_verify_cost=(1.0, 0.0))


@pytest.fixture(scope="module")
def smol(default_model_path: Path) -> Iterator[tuple[Engine, TestClient]]:
    cc = CacheConfig(block_size=16, ram_budget_bytes=256 * 1024**2)
    engine = Engine.load(default_model_path, PINNED, cc, cache=build_cache(cc))
    try:
        with TestClient(create_app(engine, ServerConfig())) as client:
            yield engine, client
    finally:
        engine.close()


def test_tools_go_into_the_system_turn(smol: tuple[Engine, TestClient]) -> None:
    engine, client = smol
    base = {"model": "default", "system": "You are helpful.",
            "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    # the template alone drops tools: same tokens with and without them
    msgs = [{"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Weather in Paris?"}]
    fn = [{"type": "function", "function": {"name": TOOL["name"],
                                            "description": TOOL["description"],
                                            "parameters": TOOL["input_schema"]}}]
    assert engine.render_chat(msgs, tools=fn) == engine.render_chat(msgs)
    without = client.post("/v1/messages/count_tokens", json=base).json()["input_tokens"]
    with_tools = client.post("/v1/messages/count_tokens",
                             json={**base, "tools": [TOOL]}).json()["input_tokens"]
    block = len(engine.tokenizer.encode("\n\n" + tools_text(fn), add_special_tokens=False))
    print(f"SmolLM2 count_tokens: {without} without tools, {with_tools} with one tool "
          f"(the block alone: {block} tokens)")
    assert abs((with_tools - without) - block) <= 2


def test_tool_history_and_placement_are_rendered(smol: tuple[Engine, TestClient],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    engine, client = smol
    submitted = spy_submits(engine, monkeypatch)
    r = client.post("/v1/messages", json={
        "model": "default", "max_tokens": 1, "tools": [TOOL], "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "system", "content": "MID-SYSTEM-NOTE"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
                                               "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": "sunny, 21C"}]}]})
    assert r.status_code == 200, r.text
    prep = client.app.state.pc_prepare  # type: ignore[attr-defined]
    assert (prep.abilities().mid_system, prep.abilities().tools) == (True, False)
    text = engine.tokenizer.decode(list(submitted[-1].prompt_tokens))
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '"name": "get_weather"' in text.split("<|im_end|>")[0]
    # the system turn stays where it stood: after the first user turn
    assert "Weather in Paris?<|im_end|>\n<|im_start|>system\nMID-SYSTEM-NOTE<|im_end|>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_forced_call_leaks_no_markup(smol: tuple[Engine, TestClient]) -> None:
    """``tool_choice`` any / required (parallel calls allowed): SmolLM2 writes its call,
    then starts another until max_tokens cuts it; the cut one is dropped, never text."""
    _, client = smol
    fn = [{"type": "function", "function": {"name": TOOL["name"],
                                            "description": TOOL["description"],
                                            "parameters": TOOL["input_schema"]}}]
    hi = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.post("/v1/chat/completions", json={
        "model": "default", "max_tokens": 60, "temperature": 0, "messages": hi,
        "tools": fn, "tool_choice": "required"}).json()
    assert r["usage"]["completion_tokens"] == 60  # cut inside the second call
    msg = r["choices"][0]["message"]
    assert msg["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in msg["tool_calls"]] == [("get_weather", {"city": "Paris"})]
    body = client.post("/v1/messages", json={
        "model": "default", "max_tokens": 60, "temperature": 0, "messages": hi,
        "tools": [TOOL], "tool_choice": {"type": "any"}, "stream": True}).text
    assert "<tool_call" not in body and '"text_delta"' not in body
    assert sse_checks.anthropic_stream(body)["content"] == [
        {"type": "tool_use", "id": ANY, "name": "get_weather", "input": {"city": "Paris"}}]


def test_anthropic_usage_agrees_streamed_and_not(smol: tuple[Engine, TestClient]) -> None:
    """The same prompt again: message_start predicts what message_delta and the
    non-streamed reply report (the prompt is stored whole: nothing created, its last
    token is input)."""
    _, client = smol
    body = {"model": "default", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Usage check: say one word."}]}
    first = client.post("/v1/messages", json=body).json()["usage"]
    prompt = sum(first[k] for k in ("input_tokens", "cache_creation_input_tokens",
                                    "cache_read_input_tokens"))
    assert first["cache_creation_input_tokens"] == prompt - first["cache_read_input_tokens"]
    got = sse_checks.anthropic_stream(client.post("/v1/messages",
                                                  json={**body, "stream": True}).text)
    again = client.post("/v1/messages", json=body).json()["usage"]
    assert got["start_usage"] == {**got["usage"], "output_tokens": 0}
    assert got["usage"] == again
    assert (again["input_tokens"], again["cache_creation_input_tokens"],
            again["cache_read_input_tokens"]) == (1, 0, prompt - 1)


def test_prefill_is_left_open(smol: tuple[Engine, TestClient]) -> None:
    engine, _ = smol
    tokens = engine.render_chat([{"role": "user", "content": "JSON please"},
                                 {"role": "assistant", "content": "{"}],
                                continue_final_message=True)
    assert engine.tokenizer.decode(tokens).endswith("<|im_start|>assistant\n{")


def test_a_chat_template_that_takes_tools_replaces_the_models(default_model_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """``--chat-template`` (E3's template): the tools go to the template, not into the
    system turn, and ours prefills the tokens mlx_lm.server renders from the same
    template (it parses each call's arguments into a dict, as ours does): E3 sends its
    tools in ours' canonical form (sorted by name, the conventional key order, property
    names sorted), which ours renders unchanged; both parse the calls of a reply with
    mlx-lm's parser for that template."""

    from harness.concurrent_plans import build
    from harness.tool_template import TOOLS_TEMPLATE

    plan = build("E3", quick=True)
    assert plan.chat_template == TOOLS_TEMPLATE
    assert build("E5", quick=True).chat_template is None
    job = plan.rounds[0][0][1]  # the report turn: read, write and test calls in its history
    engine = Engine.load(default_model_path, PINNED, None,
                         chat_template=TOOLS_TEMPLATE)
    try:
        # mlx-lm infers its json_tools parser from the template: replies' calls are parsed
        assert engine.tokenizer.tool_call_start == "<tool_call>"
        submitted = spy_submits(engine, monkeypatch)
        config = ServerConfig()
        with TestClient(create_app(engine, config)) as client:
            r = client.post("/v1/chat/completions", json={
                "model": "default", "max_tokens": 1, "messages": list(job.messages),
                "tools": list(job.tools)})
            assert r.status_code == 200, r.text
            assert client.app.state.pc_prepare.abilities().tools  # type: ignore[attr-defined]
        peer = [dict(m) for m in job.messages]
        for m in peer:  # what mlx_lm.server does to a request's calls before rendering
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(
                c["function"]["arguments"])}} for c in m.get("tool_calls") or []] or None
            if m["tool_calls"] is None:
                del m["tool_calls"]
        expected = engine.tokenizer.apply_chat_template(
            peer, tools=list(job.tools), add_generation_prompt=True, tokenize=False)
        text = engine.tokenizer.decode(list(submitted[-1].prompt_tokens))
        assert text == expected
        assert text.count("<tool_call>") == 3 + 2  # three calls + the format's two
        assert '{"type": "function", "function": {"name": "read_file"' in text
    finally:
        engine.close()


def test_claude_code_and_codex_first_requests_fit_the_window(
        smol: tuple[Engine, TestClient]) -> None:
    """The recorded first requests of Claude Code and Codex (tests/fixtures/traffic), as
    the default model's template renders them: past the 8,192 tokens it was trained on
    (Claude Code's), within the 32,768 of its widened window (both)."""
    engine, client = smol
    traffic = Path(__file__).resolve().parents[1] / "fixtures" / "traffic"
    sizes = {}
    for api, name in (("messages", "claude_code/01-v1_messages.json"),
                      ("responses", "codex/01-v1_responses.json")):
        body = json.loads((traffic / name).read_text())["body"]
        r = client.post(f"/v1/cache/probe?api={api}", json=body)
        assert r.status_code == 200, r.text
        sizes[api] = r.json()["prompt_tokens"]
    print(f"first requests on the default model: {sizes}")
    assert sizes == {"messages": 20279, "responses": 9166}
    assert engine.context_length == 32768
