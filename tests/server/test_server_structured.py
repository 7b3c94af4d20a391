"""Tool calls in the model's own format and structured output, through every API (fake
engine; exact shapes).

- Scripted replies in the Hermes / json_tools, Qwen3-Coder XML, pythonic and Mistral
  formats come back as tool calls from chat completions, Messages and Responses,
  streamed and not; the tools fallback (a template that drops tools) asks for, and parses,
  Hermes.
- ``response_format`` / ``text.format`` / ``tool_choice`` become the engine request's
  ``Constraint`` (what it holds is asserted exactly); invalid schemas and unknown tools are
  400s in each API's shape; constrained requests switch the template's thinking off unless
  asked; an assistant prefill is the constraint's prefix; ``client.chat.completions.parse``
  reads a scripted JSON reply into a pydantic model.
- A forced reply is calls only: the call max_tokens cuts (SmolLM2's exact output) is
  dropped, no markup reaches a text field in any API, streamed or not.
"""

from __future__ import annotations

import json
import math
from typing import Any

import openai
import pydantic
import pytest
import sse_checks
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import assert_streamed_equals_whole

from promptcache.engine.api import Constraint
from promptcache.engine.formats.chat_format import ChatFormat, tool_call_format
from promptcache.engine.formats.constrained import JSON_OPTIONS
from promptcache.server import create_app
from promptcache.server.replies.toolcalls import ParsedReply, ToolCall, parse_tool_calls
from promptcache.serving_config import EngineConfig, ServerConfig

HI = [{"role": "user", "content": "weather in Paris?"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string"},
                                           "days": {"type": "integer"}},
          "required": ["city"]}
OAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
             {"type": "function", "function": {"name": "list_files", "parameters": {
                 "type": "object", "properties": {}}}}]
ANT_TOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
             for t in OAI_TOOLS]
RESP_TOOLS = [{"type": "function", **t["function"]} for t in OAI_TOOLS]
WANT = ("get_weather", {"city": "Paris", "days": 3})

# a reply with text before the call, in each format (mlx-lm's parser of the format reads it)
REPLIES = {
    "json_tools": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": '
                  '{"city": "Paris", "days": 3}}\n</tool_call>',
    "qwen3_coder": "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                   "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "pythonic": 'Checking. <|tool_call_start|>[get_weather(city="Paris", days=3)]'
                "<|tool_call_end|>",
    "mistral": 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
}


def _app(engine: FakeEngine) -> TestClient:
    return TestClient(create_app(engine, ServerConfig(),
                                 engine_config=EngineConfig(max_tokens_limit=4096,
                                                            default_max_tokens=64)))


def _engine(fmt: str | None = None, **kw: Any) -> FakeEngine:
    eng = FakeEngine(**kw)
    if fmt is not None:
        eng.chat_format = ChatFormat(eng.chat_format.think_start, eng.chat_format.think_end,
                                     eng.chat_format.thinking_kwarg,
                                     tool_format=tool_call_format(fmt))
    return eng


def _chat_call(client: TestClient, stream: bool, **extra: Any) -> tuple[str, Any, str]:
    r = client.post("/v1/chat/completions", json={"messages": HI, "tools": OAI_TOOLS,
                                                  "max_tokens": 400, "stream": stream, **extra})
    assert r.status_code == 200, r.text
    if stream:
        got = sse_checks.chat_stream(r.text)
        [call] = got["tool_calls"]
        assert got["finish_reason"] == "tool_calls"
        return call["name"], json.loads(call["arguments"]), got["content"]
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [tc] = choice["message"]["tool_calls"]
    return tc["function"]["name"], json.loads(tc["function"]["arguments"]), \
        choice["message"]["content"]


@pytest.mark.parametrize("fmt", sorted(REPLIES))
@pytest.mark.parametrize("stream", [False, True])
def test_each_format_through_every_api(fmt: str, stream: bool) -> None:
    sse_checks.assert_one_call_in_every_api(
        _app(_engine(fmt, reply=REPLIES[fmt])),
        {"chat": OAI_TOOLS, "messages": ANT_TOOLS, "responses": RESP_TOOLS}, WANT,
        "Checking.", stream)


def test_the_tools_fallback_asks_for_and_parses_hermes() -> None:
    """The template drops tools: they go into the system turn in the Hermes format, and
    the reply is parsed as Hermes even though the model's own format is another."""
    eng = _engine("qwen3_coder", renders_tools=False, reply=REPLIES["json_tools"])
    client = _app(eng)
    assert _chat_call(client, False) == (*WANT, "Checking.")
    assert b"<tool_call></tool_call> XML tags" in bytes(eng.submitted[-1].prompt_tokens)
    eng.reply = REPLIES["qwen3_coder"]  # the model's own format is not what it was asked
    body = client.post("/v1/chat/completions", json={"messages": HI, "tools": OAI_TOOLS,
                                                     "max_tokens": 400}).json()
    assert body["choices"][0]["message"] == {"role": "assistant",
                                             "content": REPLIES["qwen3_coder"]}


def test_a_format_that_fails_to_parse_stays_text() -> None:
    cut = REPLIES["qwen3_coder"].split("</parameter>")[0]
    eng = _engine("qwen3_coder", reply=cut)
    body = _app(eng).post("/v1/chat/completions", json={
        "messages": HI, "tools": OAI_TOOLS, "max_tokens": 400}).json()
    assert body["choices"][0]["message"]["content"] == cut
    assert body["choices"][0]["finish_reason"] == "stop"


# what SmolLM2-135M-Instruct (the default model: its template drops tools, the Hermes
# fallback) writes under the call grammar of ``tool_choice`` "required" (parallel calls
# allowed), max_tokens 60: one call, then the start of another, cut by max_tokens
SMOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {\n  "city": "Paris"\n}}\n</tool_call>'
SMOL_FORCED = SMOL_CALL + '\n<tool_call>\n{"name": "get_weather", "arguments": {\n  "city": "Paris"'


def _forced_replies(client: TestClient, stream: bool, max_tokens: int, choices: dict[str, Any]
                    ) -> dict[str, tuple[Any, list[tuple[str, Any]], str]]:
    """Per API: (the text it returned, its calls as (name, arguments), how it finished)."""
    out: dict[str, tuple[Any, list[tuple[str, Any]], str]] = {}
    r = client.post("/v1/chat/completions", json={
        "messages": HI, "tools": OAI_TOOLS, "tool_choice": choices["chat"],
        "max_tokens": max_tokens, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        got = sse_checks.chat_stream(r.text)
        out["chat"] = (got["content"], [(c["name"], json.loads(c["arguments"]))
                                        for c in got["tool_calls"]], got["finish_reason"])
    else:
        choice = r.json()["choices"][0]
        out["chat"] = (choice["message"]["content"],
                       [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                        for c in choice["message"].get("tool_calls", [])],
                       choice["finish_reason"])
    r = client.post("/v1/messages", json={
        "messages": HI, "tools": ANT_TOOLS, "tool_choice": choices["messages"],
        "max_tokens": max_tokens, "stream": stream})
    assert r.status_code == 200, r.text
    body = sse_checks.anthropic_stream(r.text) if stream else r.json()
    stop = body["stop"]["stop_reason"] if stream else body["stop_reason"]
    out["messages"] = ([b for b in body["content"] if b["type"] != "tool_use"],
                       [(b["name"], b["input"]) for b in body["content"]
                        if b["type"] == "tool_use"], stop)
    r = client.post("/v1/responses", json={
        "input": "weather in Paris?", "tools": RESP_TOOLS, "tool_choice": choices["responses"],
        "max_output_tokens": max_tokens, "stream": stream})
    assert r.status_code == 200, r.text
    final = sse_checks.responses_stream(r.text) if stream else r.json()
    out["responses"] = ([i for i in final["output"] if i["type"] != "function_call"],
                        [(i["name"], json.loads(i["arguments"])) for i in final["output"]
                         if i["type"] == "function_call"], final["status"])
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_reply_cut_by_max_tokens_leaks_no_markup(stream: bool) -> None:
    """A forced call with parallel calls allowed: the model (SmolLM2's exact output) goes
    on with a second call until max_tokens cuts it. The complete call comes back, the cut
    one is dropped: no ``<tool_call>`` (nor any other text) in the chat content, in an
    Anthropic text block or in a Responses message, streamed or not."""
    eng = _engine(renders_tools=False, reply=SMOL_FORCED + '\n}}\n</tool_call>')
    client = _app(eng)
    cut = len(SMOL_FORCED.encode())  # the fake engine's tokens are bytes: cut there
    got = _forced_replies(client, stream, cut, {
        "chat": "required", "messages": {"type": "any"}, "responses": "required"})
    call = ("get_weather", {"city": "Paris"})
    assert got == {"chat": ("" if stream else None, [call], "tool_calls"),
                   "messages": ([], [call], "tool_use"),
                   "responses": ([], [call], "incomplete")}
    assert all(r.constraint is not None for r in eng.submitted[-3:])
    # a named tool, cut inside its one call: no call, and no text (an empty reply)
    got = _forced_replies(client, stream, len(SMOL_CALL.encode()) - 20, {
        "chat": {"type": "function", "function": {"name": "get_weather"}},
        "messages": {"type": "tool", "name": "get_weather"},
        "responses": {"type": "function", "name": "get_weather"}})
    [message] = got["responses"][0]
    assert [part["text"] for part in message["content"]] == [""]
    assert got == {"chat": ("", [], "length"),
                   "messages": ([{"type": "text", "text": ""}], [], "max_tokens"),
                   "responses": ([message], [], "incomplete")}
    # tool_choice auto: the same cut block is the model's text (as before)
    eng.reply = SMOL_FORCED
    body = client.post("/v1/chat/completions", json={
        "messages": HI, "tools": OAI_TOOLS, "max_tokens": 400}).json()
    assert body["choices"][0]["message"]["content"] == SMOL_FORCED[len(SMOL_CALL) + 1:]


# --- constraints --------------------------------------------------------------------------


def _opts(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": {**JSON_OPTIONS, "lenient": True}}


def _last(eng: FakeEngine) -> Constraint | None:
    return eng.submitted[-1].constraint


@pytest.fixture
def eng() -> FakeEngine:
    return FakeEngine(reply='{"city": "Paris", "days": 3}')


@pytest.fixture
def app(eng: FakeEngine) -> TestClient:
    return _app(eng)


def test_response_format_becomes_a_json_schema_constraint(eng: FakeEngine,
                                                          app: TestClient) -> None:
    def post(rf: Any) -> Any:
        return app.post("/v1/chat/completions", json={"messages": HI, "response_format": rf})

    assert post({"type": "json_schema", "json_schema": {"name": "w", "schema": PARAMS,
                                                        "strict": True}}).status_code == 200
    assert _last(eng) == Constraint("json_schema", json.dumps(_opts(PARAMS)))
    post({"type": "json_object"})
    assert _last(eng) == Constraint("json_schema", json.dumps(_opts({"type": "object"})))
    post({"type": "text"})
    assert _last(eng) is None
    app.post("/v1/chat/completions", json={"messages": HI})
    assert _last(eng) is None
    # Responses text.format
    r = app.post("/v1/responses", json={"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "w", "schema": PARAMS}}})
    assert r.status_code == 200 and r.json()["text"]["format"]["type"] == "json_schema"
    assert _last(eng) == Constraint("json_schema", json.dumps(_opts(PARAMS)))
    app.post("/v1/responses", json={"input": "hi", "text": {"format": {"type": "json_object"}}})
    assert _last(eng) == Constraint("json_schema", json.dumps(_opts({"type": "object"})))


def _oai_error(r: Any, param: str, needle: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert needle in err["message"], err["message"]


def _ant_error(r: Any, needle: str) -> None:
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert needle in body["error"]["message"], body["error"]["message"]


def test_invalid_schemas_are_400s_in_each_apis_shape(eng: FakeEngine, app: TestClient) -> None:
    bad = {"type": "foo"}
    n = len(eng.submitted)
    _oai_error(app.post("/v1/chat/completions", json={"messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": bad}}}),
        "response_format.json_schema.schema", "Invalid type: foo")
    _oai_error(app.post("/v1/chat/completions", json={"messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}}),
        "response_format.json_schema.schema", "/nope")
    _oai_error(app.post("/v1/chat/completions", json={"messages": HI, "response_format": {
        "type": "yaml"}}), "response_format.type", "json_schema")
    _oai_error(app.post("/v1/chat/completions", json={"messages": HI, "response_format": {
        "type": "json_schema"}}), "response_format.json_schema", "schema")
    _oai_error(app.post("/v1/responses", json={"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": bad}}}), "text.format.schema",
        "Invalid type: foo")
    _oai_error(app.post("/v1/responses", json={"input": "hi", "text": {"format": "json"}}),
               "text.format", "must be an object")
    # a forced call compiles the tool's schema
    tools = [{"name": "f", "input_schema": {"type": "object", "properties": {
        "x": {"type": "foo"}}}}]
    _ant_error(app.post("/v1/messages", json={"messages": HI, "max_tokens": 5, "tools": tools,
                                              "tool_choice": {"type": "any"}}),
               "Invalid type: foo")
    assert len(eng.submitted) == n  # nothing reached the engine
    # tool_choice auto does not compile the schemas
    r = app.post("/v1/messages", json={"messages": HI, "max_tokens": 5, "tools": tools,
                                       "tool_choice": {"type": "auto"}})
    assert r.status_code == 200 and _last(eng) is None


def test_tool_choice_becomes_a_call_grammar(eng: FakeEngine, app: TestClient) -> None:
    def chat(choice: Any, **extra: Any) -> Any:
        return app.post("/v1/chat/completions", json={
            "messages": HI, "tools": OAI_TOOLS, "tool_choice": choice, **extra})

    assert chat("required").status_code == 200
    spec = _last(eng).spec  # type: ignore[union-attr]
    assert spec.splitlines()[0] == "start: calls"
    assert "call: call_0 | call_1" in spec and 'calls: call ("\\n" call)*' in spec
    assert '"\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": " args_0' in spec
    assert "args_0: %json " + json.dumps(_opts(PARAMS)) in spec
    chat("required", parallel_tool_calls=False)
    assert "calls: call\n" in _last(eng).spec + "\n"  # type: ignore[union-attr]
    chat({"type": "function", "function": {"name": "list_files"}})
    spec = _last(eng).spec  # type: ignore[union-attr]
    assert "call: call_0\n" in spec and "list_files" in spec and "get_weather" not in spec
    for choice in ("auto", "none", None):
        chat(choice)
        assert _last(eng) is None
    _oai_error(chat({"type": "function", "function": {"name": "rm_rf"}}), "tool_choice",
               "'rm_rf' is not among the offered tools")
    _oai_error(app.post("/v1/chat/completions", json={"messages": HI, "tool_choice": "required"}),
               "tool_choice", "no tools were offered")
    _oai_error(chat("sometimes"), "tool_choice", "expected 'auto'")
    # Responses: a named function, allowed_tools in mode required
    def resp(choice: Any) -> Any:
        return app.post("/v1/responses", json={"input": "hi", "tools": RESP_TOOLS,
                                               "tool_choice": choice})

    assert resp({"type": "function", "name": "get_weather"}).status_code == 200
    assert "call: call_0\n" in _last(eng).spec  # type: ignore[union-attr]
    resp({"type": "allowed_tools", "mode": "required",
          "tools": [{"type": "function", "name": "list_files"}]})
    spec = _last(eng).spec  # type: ignore[union-attr]
    assert "list_files" in spec and "get_weather" not in spec
    resp({"type": "allowed_tools", "mode": "auto", "tools": []})
    assert _last(eng) is None
    _oai_error(resp({"type": "function", "name": "nope"}), "tool_choice", "not among")
    # Anthropic any / tool / disable_parallel_tool_use
    def msg(choice: Any) -> Any:
        return app.post("/v1/messages", json={"messages": HI, "max_tokens": 5,
                                              "tools": ANT_TOOLS, "tool_choice": choice})

    assert msg({"type": "any"}).status_code == 200
    assert "call: call_0 | call_1" in _last(eng).spec  # type: ignore[union-attr]
    msg({"type": "any", "disable_parallel_tool_use": True})
    assert "calls: call\n" in _last(eng).spec + "\n"  # type: ignore[union-attr]
    msg({"type": "tool", "name": "get_weather"})
    spec = _last(eng).spec  # type: ignore[union-attr]
    assert "get_weather" in spec and "list_files" not in spec
    _ant_error(msg({"type": "tool", "name": "nope"}), "'nope' is not among the offered tools")
    r = app.post("/v1/messages/count_tokens", json={"messages": HI, "tools": ANT_TOOLS,
                                                    "tool_choice": {"type": "any"}})
    assert r.status_code == 200


def test_the_grammar_writes_calls_in_the_models_format() -> None:
    eng = _engine("qwen3_coder")
    client = _app(eng)
    client.post("/v1/chat/completions", json={"messages": HI, "tools": OAI_TOOLS,
                                              "tool_choice": "required"})
    spec = eng.submitted[-1].constraint.spec  # type: ignore[union-attr]
    assert '"\\n<function=get_weather>\\n"' in spec and "<parameter=city>" in spec
    # the fallback: the model was asked for Hermes, the grammar writes Hermes
    eng = _engine("qwen3_coder", renders_tools=False)
    client = _app(eng)
    client.post("/v1/chat/completions", json={"messages": HI, "tools": OAI_TOOLS,
                                              "tool_choice": "required"})
    spec = eng.submitted[-1].constraint.spec  # type: ignore[union-attr]
    assert "<function=" not in spec and '\\"arguments\\": "' in spec


def test_constrained_replies_do_not_think_unless_asked() -> None:
    eng = FakeEngine(think=True, reply='{"ok": true}')
    client = _app(eng)
    rf = {"type": "json_object"}
    client.post("/v1/chat/completions", json={"messages": HI, "response_format": rf})
    assert eng.template_kwargs[-1] == {"enable_thinking": False}
    assert eng.submitted[-1].constraint.kind == "json_schema"  # type: ignore[union-attr]
    # asked for: the template opens <think>; the grammar lets it reason first
    eng.reply = 'Hmm.</think>{"ok": true}'
    body = client.post("/v1/chat/completions", json={
        "messages": HI, "response_format": rf, "reasoning_effort": "high"}).json()
    assert eng.template_kwargs[-1] == {"enable_thinking": True}
    c = eng.submitted[-1].constraint
    assert c is not None and c.kind == "lark"
    assert c.spec.splitlines()[0] == "start: think think_gap? (answer_json)"
    assert 'think[suffix="</think>"]: /(?s:.*)/' in c.spec
    msg = body["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("Hmm.", '{"ok": true}')
    # Anthropic thinking enabled + tool_choice any: the reply may open <think> itself
    eng.reply = "x"
    client.post("/v1/messages", json={"messages": HI, "max_tokens": 5, "tools": ANT_TOOLS,
                                      "tool_choice": {"type": "any"},
                                      "thinking": {"type": "enabled", "budget_tokens": 1024}})
    c = eng.submitted[-1].constraint
    assert c is not None and c.spec.splitlines()[0] == "start: think think_gap? (calls)"


def test_a_prefill_is_the_constraints_prefix(eng: FakeEngine, app: TestClient) -> None:
    eng.reply = '"Paris"}'
    r = app.post("/v1/chat/completions", json={
        "messages": HI + [{"role": "assistant", "content": '{"city": '}],
        "response_format": {"type": "json_object"}})
    assert r.json()["choices"][0]["message"]["content"] == '"Paris"}'
    assert _last(eng) == Constraint("json_schema", json.dumps(_opts({"type": "object"})),
                                    prefix='{"city": ')
    # a forced call after a prefill's text: the call follows it
    app.post("/v1/messages", json={"messages": HI + [
        {"role": "assistant", "content": "Let me check."}], "max_tokens": 50,
        "tools": ANT_TOOLS, "tool_choice": {"type": "any"}})
    c = _last(eng)
    assert c is not None and c.prefix == ""
    assert c.spec.splitlines()[0] == 'start: ("\\n" | "\\n\\n" | " ")? calls'


class Weather(pydantic.BaseModel):
    city: str
    days: int


def test_sdk_parse_reads_the_json_reply(eng: FakeEngine, app: TestClient) -> None:
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=app)
    done = oai.chat.completions.parse(model="default", messages=HI,  # type: ignore[arg-type]
                                      response_format=Weather)
    assert done.choices[0].message.parsed == Weather(city="Paris", days=3)
    c = _last(eng)
    assert c is not None and c.kind == "json_schema"
    schema = json.loads(c.spec)
    assert schema["properties"] == {"city": {"title": "City", "type": "string"},
                                    "days": {"title": "Days", "type": "integer"}}
    assert schema["additionalProperties"] is False and schema["required"] == ["city", "days"]


def test_schemas_are_compiled_leniently(eng: FakeEngine, app: TestClient) -> None:
    for schema in [{"type": "object", "dependentRequired": {"a": ["b"]}},
                   {"type": "string", "format": "foo-bar"}]:
        r = app.post("/v1/chat/completions", json={"messages": HI, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
        assert r.status_code == 200, r.text


def test_a_prefill_the_schema_cannot_continue_is_a_400(tiny_llama_path: Any) -> None:
    """With the engine's tokenizer the constraint is compiled, prefix included, while the
    prompt is prepared."""
    from types import SimpleNamespace

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from promptcache.server.api.errors import APIError
    from promptcache.server.prompts.structured import check_constraint

    engine = SimpleNamespace(tokenizer=load_tokenizer(tiny_llama_path), vocab_size=1024)
    schema = json.dumps(_opts(PARAMS))
    check_constraint(Constraint("json_schema", schema, prefix='{"city": "Pa'), engine, "x")
    with pytest.raises(APIError) as info:
        check_constraint(Constraint("json_schema", schema, prefix="Sure!"), engine,
                         "response_format")
    assert info.value.status == 400 and info.value.param == "response_format"
    assert "the assistant prefill 'Sure!' does not match the JSON schema" in info.value.message


def test_masked_alternatives_are_left_out_of_logprobs() -> None:
    import asyncio

    from fake_engine import FakeTokenizer

    from promptcache.engine.api import TokenEvent
    from promptcache.server.replies.reply import LogprobDecoder

    ev = TokenEvent(65, "A", logprob=-0.25, top_logprobs=((65, -0.25), (66, -math.inf)))
    [entry] = asyncio.run(LogprobDecoder(FakeTokenizer()).entries([ev]))
    assert entry == {"token": "A", "logprob": -0.25, "bytes": [65], "top_logprobs": [
        {"token": "A", "logprob": -0.25, "bytes": [65]}]}


def test_the_token_that_ended_the_reply_has_no_logprob_entry() -> None:
    """EOS (the tokenizer's) or a requested stop token id is not content (OpenAI)."""
    import asyncio

    from fake_engine import FakeTokenizer

    from promptcache.engine.api import TokenEvent
    from promptcache.server.replies.reply import LogprobDecoder

    tok = FakeTokenizer()
    tok.eos_token_ids = [2]  # type: ignore[attr-defined]
    evs = [TokenEvent(65, "A", logprob=-0.5, top_logprobs=((65, -0.5),)),
           TokenEvent(2, "", logprob=-0.1, top_logprobs=((2, -0.1),)),
           TokenEvent(9, "", logprob=-0.1, top_logprobs=((9, -0.1),))]
    got = asyncio.run(LogprobDecoder(tok, (9,)).entries(evs))
    assert [e["token"] for e in got] == ["A"]
    # without them the same ids are ordinary tokens
    got = asyncio.run(LogprobDecoder(FakeTokenizer()).entries(evs))
    assert len(got) == 3


FORMAT_REPLIES = [(fmt, reply) for fmt, reply in REPLIES.items()] + [
    ("qwen3_coder", REPLIES["qwen3_coder"] + "\nDone." + REPLIES["qwen3_coder"]),
    ("pythonic", "<|tool_call_start|>[get_weather(city=1 2)]<|tool_call_end|> x"),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]list_files[ARGS]{}'),
    ("mistral", "[TOOL_CALLS]rm_rf[ARGS]{}"),
    ("json_tools", "plain <tool_cal"),
]


@settings(max_examples=120, deadline=None)
@given(st.sampled_from(FORMAT_REPLIES), st.lists(st.integers(0, 200), max_size=8))
def test_streamed_and_whole_parses_agree_in_every_format(case: tuple[str, str],
                                                         cuts: list[int]) -> None:
    fmt_name, reply = case
    assert_streamed_equals_whole(reply, cuts, {"get_weather", "list_files"},
                                 tool_call_format(fmt_name), OAI_TOOLS)


def test_what_each_format_parses_to() -> None:
    names = {"get_weather", "list_files"}
    two = parse_tool_calls(FORMAT_REPLIES[6][1], names, tool_call_format("mistral"))
    assert two == ParsedReply("", (ToolCall("get_weather", {"city": "Paris"}),
                                   ToolCall("list_files", {})))
    rm = FORMAT_REPLIES[7][1]
    assert parse_tool_calls(rm, names, tool_call_format("mistral")) == ParsedReply(rm)
    again = parse_tool_calls(FORMAT_REPLIES[4][1], names, tool_call_format("qwen3_coder"),
                             OAI_TOOLS)
    assert again == ParsedReply("Checking.\n\nDone.Checking.", (ToolCall(*WANT), ToolCall(*WANT)))
