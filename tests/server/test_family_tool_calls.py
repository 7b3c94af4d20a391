"""Tool calls of each tiny family end to end, in its own template's format.

- The call text each family's template writes (``test_family_templates.RENDERED``), sent
  as a model's reply after some text, is parsed back as that call through chat,
  Messages and Responses, streamed and whole, with the chat format promptcache detects
  from the family's real tokenizer (harmony, Qwen3-Coder XML, GLM, DeepSeek, Kimi-K2,
  Qwen3 / Falcon-H1 JSON).
- A forced call (``tool_choice`` a named function / ``required``, Anthropic ``tool`` /
  ``any``) on each family's tiny model (random weights: only the grammar in the family's
  format gives the reply its shape) comes back as exactly one call of the tool with
  arguments of its schema, in every API, streamed and whole.
- harmony: the grammar names its markers by id and writes the commentary message to
  ``functions.NAME`` ending in ``<|call|>``; a JSON answer is the final channel's
  message.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sse_checks
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from models import tiny_families as tf
from real_engine import tiny_engine
from sse_checks import anthropic_stream, chat_stream, responses_stream

from promptcache.engine.formats.chat_format import chat_format_of
from promptcache.server import create_app
from promptcache.serving_config import EngineConfig, ServerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from test_family_templates import ARGS, RENDERED  # noqa: E402

PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}
NOARGS = {"type": "object", "properties": {}, "additionalProperties": False}
OAI = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
       {"type": "function", "function": {"name": "list_files", "parameters": NOARGS}}]
ANT = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
       for t in OAI]
RESP = [{"type": "function", **t["function"]} for t in OAI]
TOOLS = {"chat": OAI, "messages": ANT, "responses": RESP}
HI = [{"role": "user", "content": "What is the weather in Paris?"}]
FAMILIES = [f for f in tf.FAMILIES if f != "qwen3_4bit"]  # qwen3's template and format


@pytest.fixture(scope="module")
def family_path(models_root: Path) -> Callable[[str], Path]:
    return lambda family: tf.ensure_family_model(family, models_root)


# --- the template's own call text, parsed back -------------------------------------------

# text before the call, as each format writes it (harmony: a commentary preamble)
PREAMBLE = {"gpt_oss": "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"}
PARSED = ["gpt_oss", "qwen3_moe", "qwen3_5", "nemotron_h", "glm4_moe_lite", "deepseek_v3",
          "kimi_linear", "qwen3", "falcon_h1"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("family", PARSED)
def test_the_templates_call_text_is_a_call_in_every_api(
        family_path: Callable[[str], Path], family: str, stream: bool) -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    call = RENDERED[family][0]
    assert call is not None
    eng = FakeEngine(reply=PREAMBLE.get(family, "Checking.") + call)
    eng.chat_format = chat_format_of(load_tokenizer(family_path(family)))
    client = TestClient(create_app(eng, ServerConfig(), engine_config=EngineConfig(
        max_tokens_limit=4096, default_max_tokens=64)))
    tools = {"chat": OAI[:1], "messages": ANT[:1], "responses": RESP[:1]}
    sse_checks.assert_one_call_in_every_api(client, tools, ("get_weather", ARGS),
                                            "Checking.", stream)


# --- forced calls on the tiny models -------------------------------------------------------


@pytest.fixture(scope="module", params=FAMILIES)
def served(request: pytest.FixtureRequest, family_path: Callable[[str], Path]
           ) -> Iterator[tuple[str, TestClient]]:
    family = str(request.param)
    eng = tiny_engine(family_path(family), None)
    try:
        yield family, TestClient(create_app(eng, ServerConfig(prerender=False)))
    finally:
        eng.close()


def _check(name: str, args: dict[str, Any]) -> None:
    if name == "get_weather":
        assert set(args) == {"city", "days"}
        assert args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 9
    else:
        assert (name, args) == ("list_files", {})


def _chat(client: TestClient, stream: bool, choice: Any) -> list[tuple[str, dict[str, Any]]]:
    r = client.post("/v1/chat/completions", json={
        "messages": HI, "tools": OAI, "tool_choice": choice, "parallel_tool_calls": False,
        "max_tokens": 200, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        got = chat_stream(r.text)
        assert got["finish_reason"] == "tool_calls" and got["content"] == ""
        return [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]]
    choice0 = r.json()["choices"][0]
    assert choice0["finish_reason"] == "tool_calls" and not choice0["message"]["content"]
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in choice0["message"]["tool_calls"]]


def _messages(client: TestClient, stream: bool, choice: Any
              ) -> list[tuple[str, dict[str, Any]]]:
    r = client.post("/v1/messages", json={"messages": HI, "tools": ANT, "tool_choice": choice,
                                          "max_tokens": 200, "stream": stream})
    assert r.status_code == 200, r.text
    body = anthropic_stream(r.text) if stream else r.json()
    stop = body["stop"]["stop_reason"] if stream else body["stop_reason"]
    assert stop == "tool_use"
    assert [b["type"] for b in body["content"]] == ["tool_use"]
    return [(b["name"], b["input"]) for b in body["content"]]


def _responses(client: TestClient, stream: bool, choice: Any
               ) -> list[tuple[str, dict[str, Any]]]:
    r = client.post("/v1/responses", json={"input": "weather?", "tools": RESP,
                                           "tool_choice": choice, "parallel_tool_calls": False,
                                           "max_output_tokens": 200, "stream": stream})
    assert r.status_code == 200, r.text
    final = responses_stream(r.text) if stream else r.json()
    assert [item["type"] for item in final["output"]] == ["function_call"]
    return [(item["name"], json.loads(item["arguments"])) for item in final["output"]]


@pytest.mark.parametrize("stream", [False, True])
def test_forced_call_in_every_api(served: tuple[str, TestClient], stream: bool) -> None:
    _, client = served
    named = _chat(client, stream, {"type": "function", "function": {"name": "get_weather"}})
    assert [n for n, _ in named] == ["get_weather"]
    _check(*named[0])
    [required] = _chat(client, stream, "required")
    _check(*required)
    [tool] = _messages(client, stream, {"type": "tool", "name": "list_files"})
    assert tool == ("list_files", {})
    [any_] = _messages(client, stream, {"type": "any", "disable_parallel_tool_use": True})
    _check(*any_)
    [resp] = _responses(client, stream, {"type": "function", "name": "get_weather"})
    assert resp[0] == "get_weather"
    _check(*resp)


def test_harmony_grammar_names_its_markers(family_path: Callable[[str], Path]) -> None:
    eng = FakeEngine()
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    eng.chat_format = chat_format_of(load_tokenizer(family_path("gpt_oss")))
    client = TestClient(create_app(eng, ServerConfig()))
    r = client.post("/v1/chat/completions", json={
        "messages": HI, "tools": OAI, "max_tokens": 50,
        "tool_choice": {"type": "function", "function": {"name": "list_files"}}})
    assert r.status_code == 200, r.text
    ids = tf.family_special_ids("gpt_oss")
    spec = eng.submitted[-1].constraint
    assert spec is not None and spec.kind == "lark"
    assert spec.spec.splitlines()[:2] == [
        "start: calls",
        f'call_0: <[{ids["<|channel|>"]}]> "commentary to=functions.list_files " '
        f'<[{ids["<|constrain|>"]}]> "json" <[{ids["<|message|>"]}]> args_0 '
        f'<[{ids["<|call|>"]}]>']


def test_harmony_json_answer_is_the_final_message(family_path: Callable[[str], Path]
                                                  ) -> None:
    eng = tiny_engine(family_path("gpt_oss"), None)
    try:
        client = TestClient(create_app(eng, ServerConfig(prerender=False)))
        schema = {"type": "object", "properties": {"city": PARAMS["properties"]["city"]},
                  "required": ["city"], "additionalProperties": False}
        r = client.post("/v1/chat/completions", json={
            "messages": HI, "max_tokens": 100, "response_format": {
                "type": "json_schema", "json_schema": {"name": "w", "schema": schema}}})
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        answer = json.loads(message["content"])
        assert set(answer) == {"city"} and answer["city"] in ("Paris", "Rome")
        assert not message.get("reasoning_content") and not message.get("tool_calls")
    finally:
        eng.close()
