"""Tool calls and structured output through a real `promptcache serve` (tiny random llama).

The tiny model's weights are random: only the constraint makes its output well-formed,
so every assertion here is about what constrained decoding guarantees. One server per
tool-call format: the plain tiny model (its template is not one mlx-lm recognises: the
Hermes fallback) and copies whose ``tokenizer_config.json`` names mlx-lm's ``qwen3_coder``,
``pythonic`` and ``mistral`` parsers. Forced calls come back as calls through chat
completions (streamed and not), Messages and Responses, their arguments matching the
schema; ``client.chat.completions.parse`` fills a pydantic model; invalid schemas and
prefills are 400s; logprobs are those of the constrained distribution.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pydantic
import pytest
from serve_proc import serve

FORMATS = ("hermes", "qwen3_coder", "pythonic", "mistral")
PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}
OAI_TOOLS: Any = [{"type": "function", "function": {"name": "get_weather",
                                                    "parameters": PARAMS}},
                  {"type": "function", "function": {"name": "list_files", "parameters": {
                      "type": "object", "properties": {}, "additionalProperties": False}}}]
ANT_TOOLS: Any = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                  for t in OAI_TOOLS]
RESP_TOOLS: Any = [{"type": "function", **t["function"]} for t in OAI_TOOLS]
HI: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


def _model_folder(src: Path, dst: Path, parser: str | None) -> Path:
    if parser is None:
        return src
    shutil.copytree(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config["tool_parser_type"] = parser
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module", params=FORMATS)
def server(request: pytest.FixtureRequest, tiny_llama_path: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    fmt = str(request.param)
    tmp = tmp_path_factory.mktemp(f"serve-{fmt}")
    model = _model_folder(tiny_llama_path, tmp / "model", None if fmt == "hermes" else fmt)
    with serve(["--model", str(model), "--no-ssd", "--log-level", "info"],
               tmp / "server.log", timeout=90, log_tail=2000) as base:
        yield fmt, base


def _oai(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def _check_args(name: str, args: dict[str, Any]) -> None:
    if name == "get_weather":
        assert set(args) == {"city", "days"}
        assert args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 9
    else:
        assert (name, args) == ("list_files", {})


def test_forced_calls_through_every_api(server: tuple[str, str]) -> None:
    fmt, base = server
    client = _oai(base)
    r = client.chat.completions.create(
        model="default", messages=HI, tools=OAI_TOOLS, max_tokens=300,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", (fmt, choice.message)
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    _check_args("get_weather", json.loads(call.function.arguments))  # type: ignore[union-attr]
    # required, one call, streamed
    with client.chat.completions.stream(model="default", messages=HI, tools=OAI_TOOLS,
                                        max_tokens=300, tool_choice="required",
                                        parallel_tool_calls=False) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    [call] = final.choices[0].message.tool_calls or []
    _check_args(call.function.name, json.loads(call.function.arguments))  # type: ignore[union-attr]
    # Anthropic any (one call) and tool
    ant = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    for choice_ in ({"type": "any", "disable_parallel_tool_use": True},
                    {"type": "tool", "name": "list_files"}):
        msg = ant.messages.create(model="default", max_tokens=300, messages=HI,
                                  tools=ANT_TOOLS, tool_choice=choice_)  # type: ignore[arg-type]
        assert msg.stop_reason == "tool_use", (fmt, msg.content)
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert len(uses) == 1
        _check_args(uses[0].name, dict(uses[0].input))  # type: ignore[arg-type, union-attr]
        if choice_["type"] == "tool":
            assert uses[0].name == "list_files"  # type: ignore[union-attr]
    # Responses, streamed
    with httpx.stream("POST", f"{base}/v1/responses", json={
            "input": "weather?", "tools": RESP_TOOLS, "stream": True,
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 300}, timeout=120) as resp:
        body = "".join(resp.iter_text())
    done = [json.loads(line[6:]) for line in body.splitlines()
            if line.startswith("data: ") and '"response.completed"' in line]
    [fc] = [item for item in done[0]["response"]["output"] if item["type"] == "function_call"]
    assert fc["name"] == "get_weather"
    _check_args("get_weather", json.loads(fc["arguments"]))


class Unit(StrEnum):
    c = "c"
    f = "f"


class Forecast(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    days: int = pydantic.Field(ge=1, le=9)
    unit: Unit
    sunny: bool


def test_sdk_parse_fills_the_pydantic_model(server: tuple[str, str]) -> None:
    fmt, base = server
    if fmt != "hermes":
        pytest.skip("the format of tool calls does not matter here")
    client = _oai(base)
    done = client.chat.completions.parse(model="default", messages=HI, max_tokens=300,
                                         response_format=Forecast)
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Forecast), done.choices[0].message.content
    assert len(parsed.city) <= 12 and 1 <= parsed.days <= 9
    # Responses text.format json_schema; streaming chat json_object
    r = httpx.post(f"{base}/v1/responses", json={
        "input": "weather?", "max_output_tokens": 300, "text": {"format": {
            "type": "json_schema", "name": "f", "strict": True,
            "schema": Forecast.model_json_schema()}}}, timeout=120).json()
    Forecast.model_validate_json(r["output"][0]["content"][0]["text"])
    stream = client.chat.completions.create(
        model="default", messages=HI, max_tokens=300, stream=True,
        response_format={"type": "json_schema", "json_schema": {
            "name": "p", "schema": PARAMS}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    _check_args("get_weather", json.loads(text))


def test_bad_schemas_and_prefills_are_400s(server: tuple[str, str]) -> None:
    fmt, base = server
    if fmt != "hermes":
        pytest.skip("the format of tool calls does not matter here")
    client = _oai(base)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="default", messages=HI, max_tokens=20,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": "foo"}}})
    assert "Invalid type: foo" in str(err.value)
    with pytest.raises(openai.BadRequestError, match="prefill 'Sure!' does not match"):
        client.chat.completions.create(
            model="default", max_tokens=20, response_format={"type": "json_object"},
            messages=HI + [{"role": "assistant", "content": "Sure!"}])
    ant = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="Invalid type: foo"):
        ant.messages.create(model="default", max_tokens=20, messages=HI,
                            tool_choice={"type": "any"},
                            tools=[{"name": "f", "input_schema": {  # type: ignore[list-item]
                                "type": "object", "properties": {"x": {"type": "foo"}}}}])
    # a prefill the schema continues: prefill + reply is the JSON
    prefill = '{"city": "Ro'
    r = client.chat.completions.create(
        model="default", max_tokens=300,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PARAMS}},
        messages=HI + [{"role": "assistant", "content": prefill}])
    value = json.loads(prefill + (r.choices[0].message.content or ""))
    assert value["city"] == "Rome" and 1 <= value["days"] <= 9


def test_logprobs_are_those_of_the_constrained_distribution(server: tuple[str, str]) -> None:
    fmt, base = server
    if fmt != "hermes":
        pytest.skip("the format of tool calls does not matter here")
    client = _oai(base)
    r = client.chat.completions.create(model="default", messages=HI, max_tokens=8,
                                       logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert entries is not None and r.usage is not None
    assert len(entries) == r.usage.completion_tokens == 8
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # greedy: the chosen token is the most likely one
        assert e.top_logprobs[0].token == e.token and math.isclose(tops[0], e.logprob,
                                                                   abs_tol=1e-5)
    # under a constraint that allows one answer, only tokens that spell it have mass and
    # the masked alternatives are left out (JSON has no -inf)
    r = client.chat.completions.create(
        model="default", messages=HI, max_tokens=20, logprobs=True, top_logprobs=5,
        response_format={"type": "json_schema", "json_schema": {
            "name": "c", "schema": {"const": "ok"}}})
    assert r.choices[0].message.content == '"ok"'
    entries = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert entries and "".join(e.token for e in entries) == '"ok"'
    done = ""
    for e in entries:
        assert math.isfinite(e.logprob) and e.top_logprobs
        assert all(math.isfinite(t.logprob) for t in e.top_logprobs)
        # every alternative with mass continues the answer from where it stands
        rest = '"ok"'[len(done):]
        assert all(t.token and rest.startswith(t.token) for t in e.top_logprobs), (done, e)
        assert e.token in [t.token for t in e.top_logprobs]
        done += e.token
        assert sum(math.exp(t.logprob) for t in e.top_logprobs) <= 1.0 + 1e-4
