"""The OpenAI Responses API against the fake engine: shapes, streaming (also through
the official SDK), previous_response_id and the store, tools, bad input."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import sse_checks
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from promptcache.server import create_app
from promptcache.serving_config import ServerConfig

WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def _post(client: TestClient, **body: Any) -> Any:
    return client.post("/v1/responses", json={"model": "default", "max_output_tokens": 200,
                                              **body})


def test_string_input_non_streaming(client: TestClient, engine: FakeEngine) -> None:
    r = _post(client, input="hi", instructions="be brief", max_output_tokens=50)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "response" and body["status"] == "completed"
    assert body["id"].startswith("resp_") and body["model"] == "fake-model"
    assert body["incomplete_details"] is None and body["error"] is None
    [msg] = body["output"]
    assert msg["type"] == "message" and msg["role"] == "assistant"
    assert msg["status"] == "completed"
    assert msg["content"] == [{"type": "output_text", "text": "Hello world!",
                               "annotations": [], "logprobs": []}]
    assert engine.rendered[-1][0] == [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": "hi"}]
    # "<|system|>be brief\n<|user|>hi\n<|assistant|>" = 19 + 11 + 13
    assert body["usage"] == {"input_tokens": 43, "input_tokens_details": {"cached_tokens": 0},
                             "output_tokens": 12,
                             "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": 55}
    assert body["instructions"] == "be brief" and body["max_output_tokens"] == 50
    assert engine.submitted[-1].sampling.max_tokens == 50


def test_items_roles_and_parts(client: TestClient, engine: FakeEngine) -> None:
    items = [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "rules"}]},
        {"role": "user", "content": "q1"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "a1"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q2"},
                                                        {"type": "input_text", "text": "!"}]},
    ]
    assert _post(client, input=items).status_code == 200
    assert engine.rendered[-1][0] == [
        {"role": "system", "content": "rules"}, {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2!"}]


def test_streaming_event_sequence_and_cached_tokens(client: TestClient) -> None:
    _post(client, input="hi")
    r = _post(client, input="hi", stream=True)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    final = sse_checks.responses_stream(r.text)
    assert final["status"] == "completed"
    assert final["output"][0]["content"][0]["text"] == "Hello world!"
    assert final["usage"]["input_tokens"] == 24
    assert final["usage"]["input_tokens_details"] == {"cached_tokens": 23}
    names = [line[len("event: "):] for line in r.text.splitlines() if line.startswith("event: ")]
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * 12 + \
        ["response.output_text.done", "response.content_part.done",
         "response.output_item.done", "response.completed"]


def test_max_output_tokens_makes_an_incomplete_response(client: TestClient) -> None:
    body = _post(client, input="hi", max_output_tokens=5).json()
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["content"][0]["text"] == "Hello"
    r = _post(client, input="hi", max_output_tokens=5, stream=True)
    final = sse_checks.responses_stream(r.text)
    assert final["status"] == "incomplete"
    assert r.text.rstrip().splitlines()[-2] == "event: response.incomplete"


def test_previous_response_id_and_store(client: TestClient, engine: FakeEngine) -> None:
    first = _post(client, input="hi", instructions="sys one").json()
    second = _post(client, input="more", previous_response_id=first["id"],
                   instructions="sys two").json()
    assert second["previous_response_id"] == first["id"]
    # the earlier instructions are not carried over; the earlier turn is
    assert engine.rendered[-1][0] == [
        {"role": "system", "content": "sys two"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello world!"}, {"role": "user", "content": "more"}]
    assert client.get(f"/v1/responses/{first['id']}").json() == first
    # store: false -> not kept
    unstored = _post(client, input="x", store=False).json()
    assert unstored["store"] is False
    r = client.get(f"/v1/responses/{unstored['id']}")
    assert r.status_code == 404
    assert r.json() == {"error": {"message": f"Response with id '{unstored['id']}' not found.",
                                  "type": "invalid_request_error", "param": None,
                                  "code": "not_found"}}
    r = _post(client, input="x", previous_response_id=unstored["id"])
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    assert client.delete(f"/v1/responses/{first['id']}").json()["deleted"] is True
    assert client.get(f"/v1/responses/{first['id']}").status_code == 404


def test_store_is_bounded(engine: FakeEngine) -> None:
    client = TestClient(create_app(engine, ServerConfig(responses_store_size=2)))
    ids = [_post(client, input=f"q{i}").json()["id"] for i in range(3)]
    assert [client.get(f"/v1/responses/{i}").status_code for i in ids] == [404, 200, 200]


def test_tool_call_round_trip(client: TestClient, engine: FakeEngine) -> None:
    engine.reply = CALL
    r = _post(client, input="weather?", tools=[WEATHER_TOOL])
    body = r.json()
    [call] = body["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert call["arguments"] == '{"city": "Paris"}' and call["status"] == "completed"
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    # streamed: the same item through function_call_arguments.delta / .done
    s = _post(client, input="weather?", tools=[WEATHER_TOOL], stream=True)
    final = sse_checks.responses_stream(s.text)
    assert [(o["type"], o["name"], o["arguments"]) for o in final["output"]] == \
        [("function_call", "get_weather", '{"city": "Paris"}')]
    # the result goes back as a function_call_output item
    engine.reply = "It is sunny."
    out = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny, 20C"}
    nxt = _post(client, previous_response_id=body["id"], input=[out], tools=[WEATHER_TOOL])
    assert nxt.status_code == 200, nxt.text
    assert nxt.json()["output"][0]["content"][0]["text"] == "It is sunny."
    rendered = engine.rendered[-1][0]
    assert rendered[-2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": call["call_id"], "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert rendered[-1] == {"role": "tool", "tool_call_id": call["call_id"],
                            "content": "sunny, 20C"}
    # or the whole history as items (what Codex does, store: false)
    items = [{"role": "user", "content": "weather?"},
             {"type": "function_call", "call_id": "c1", "name": "get_weather",
              "arguments": '{"city": "Paris"}'}, {**out, "call_id": "c1"}]
    assert _post(client, input=items, tools=[WEATHER_TOOL], store=False).status_code == 200


def test_namespace_and_server_side_tools(client: TestClient, engine: FakeEngine) -> None:
    tools = [WEATHER_TOOL,
             {"type": "namespace", "name": "agents", "description": "sub-agents",
              "tools": [{"type": "function", "name": "spawn", "parameters": {
                  "type": "object", "properties": {"task": {"type": "string"}}}}]},
             {"type": "web_search", "external_web_access": False},
             {"type": "file_search", "vector_store_ids": ["v"]}]
    engine.reply = '<tool_call>{"name": "agents__spawn", "arguments": {"task": "x"}}</tool_call>'
    body = _post(client, input="go", tools=tools).json()
    # offered sorted by name (canonical prompts, server/prompts/canon.py)
    assert [t["function"]["name"] for t in engine.rendered[-1][1]] == \
        ["agents__spawn", "get_weather"]
    [call] = body["output"]
    assert (call["name"], call["namespace"]) == ("spawn", "agents")
    # sent back, the call is shown to the model under its qualified name again
    engine.reply = "done"
    items = [{"role": "user", "content": "go"},
             {"type": "function_call", "call_id": "c9", "name": "spawn", "namespace": "agents",
              "arguments": '{"task": "x"}'},
             {"type": "function_call_output", "call_id": "c9", "output": "ok"}]
    assert _post(client, input=items, tools=tools).status_code == 200
    assert engine.rendered[-1][0][1]["tool_calls"][0]["function"]["name"] == "agents__spawn"


def test_reasoning_items(engine: FakeEngine) -> None:
    eng = FakeEngine(think=True, reply="<think>Let me see.</think>The answer.")
    client = TestClient(create_app(eng, ServerConfig()))
    body = _post(client, input="q").json()
    assert [o["type"] for o in body["output"]] == ["reasoning", "message"]
    assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": "Let me see."}]
    assert body["output"][0]["summary"] == []
    assert body["output"][1]["content"][0]["text"] == "The answer."
    assert 0 < body["usage"]["output_tokens_details"]["reasoning_tokens"] \
        < body["usage"]["output_tokens"]
    final = sse_checks.responses_stream(_post(client, input="q", stream=True).text)
    assert final["output"][0]["content"] == body["output"][0]["content"]
    # reasoning.effort drives the template's switch
    _post(client, input="q", reasoning={"effort": "low", "summary": "auto"})
    assert eng.template_kwargs[-1] == {"enable_thinking": True}
    _post(client, input="q", reasoning={"effort": "none"})
    assert eng.template_kwargs[-1] == {"enable_thinking": False}
    _post(client, input="q")
    assert eng.template_kwargs[-1] is None


def test_official_sdk(client: TestClient, engine: FakeEngine) -> None:
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client,
                        max_retries=0)
    resp = sdk.responses.create(model="default", input="hi")
    assert resp.output_text == "Hello world!"
    assert resp.usage is not None and resp.usage.input_tokens_details.cached_tokens == 0
    with sdk.responses.stream(model="default", input="hi") as stream:
        deltas = [ev.delta for ev in stream if ev.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Hello world!"
    assert final.usage is not None and final.usage.input_tokens_details.cached_tokens == 23
    engine.reply = CALL
    tool_resp = sdk.responses.create(model="default", input="w?", max_output_tokens=200,
                                     tools=[WEATHER_TOOL])  # type: ignore[list-item]
    assert tool_resp.output[0].type == "function_call"
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve("resp_nope")


@pytest.mark.parametrize("body, status, code, fragment", [
    ({"input": [{"type": "telepathy"}]}, 400, "invalid_request", "unknown item type"),
    ({"input": [{"type": "function_call_output", "call_id": "c0", "output": "x"}]}, 400,
     "invalid_request", "no tool call found"),
    ({"input": [{"type": "message", "role": "wizard", "content": "x"}]}, 400,
     "invalid_request", "unknown role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     400, "invalid_request", "not supported"),
    ({"input": [{"role": "user", "content": [{"type": "hologram"}]}]}, 400,
     "invalid_request", "unknown content part"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]},
     400, "invalid_request", "not valid JSON"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400,
     "invalid_request", "call_id"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, 404, "not_found", "not found"),
    ({"input": 42}, 400, "invalid_request", "input"),
    ({"input": ["hi"]}, 400, "invalid_request", "input"),
    ({"max_output_tokens": 9}, 400, None, "input is required"),
    ({"input": "hi", "max_output_tokens": 0}, 400, None, "max_output_tokens must be > 0"),
    ({"input": "hi", "temperature": "hot"}, 400, "invalid_request", "temperature"),
    ({"input": "hi", "tools": [{"type": "function"}]}, 400, "invalid_request", "name"),
    ({"input": "hi", "tools": [{"type": "namespace", "name": "n"}]}, 400, "invalid_request",
     "namespace"),
    ({"input": "hi", "model": "gpt-9"}, 404, "model_not_found", "not served"),
    ({"input": "hi", "top_logprobs": 50}, 400, None, "top_logprobs"),
    ({"input": "x" * 5000}, 400, "context_length_exceeded", "maximum context length"),
])
def test_bad_input_is_a_4xx_in_openai_shape(client: TestClient, body: dict[str, Any],
                                            status: int, code: str | None,
                                            fragment: str) -> None:
    r = client.post("/v1/responses", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code
    assert fragment in err["message"]
    assert _post(client, input="still fine").status_code == 200


def test_item_reference(client: TestClient, engine: FakeEngine) -> None:
    first = _post(client, input="hi").json()
    msg_id = first["output"][0]["id"]
    r = _post(client, input=[{"role": "user", "content": "hi"},
                             {"type": "item_reference", "id": msg_id},
                             {"role": "user", "content": "more"}])
    assert r.status_code == 200, r.text
    assert engine.rendered[-1][0] == [{"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": "Hello world!"},
                                      {"role": "user", "content": "more"}]
    r = _post(client, input=[{"type": "item_reference", "id": "msg_gone"}])
    assert r.status_code == 400 and "not found" in r.json()["error"]["message"]
