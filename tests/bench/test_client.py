"""SSE parsing and TTFT metering on canned streams; request body conversion."""

from __future__ import annotations

import json

import pytest

from harness.client import (
    SSEParser,
    StreamMeter,
    anthropic_body,
    meter_lines,
    openai_body,
)


def _chunk(delta: dict, usage: dict | None = None, choices: bool = True) -> str:
    obj: dict = {"object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": delta, "finish_reason": None}] if choices else []}
    if usage is not None:
        obj["usage"] = usage
    return "data: " + json.dumps(obj)


def _timed(*pairs: tuple[float, str]) -> list[tuple[float, str]]:
    out = []
    for t, line in pairs:
        out += [(t, line), (t, "")]  # each event ends with a blank line
    return out


def test_sse_parser_events_multiline_data_comments_and_crlf() -> None:
    p = SSEParser()
    got = []
    for line in ["event: a\r\n", "data: x", "data: y", "", ": keep-alive", "", "data:z", ""]:
        got += list(p.feed(line))
    got += list(p.close())
    assert got == [("a", "x\ny"), ("message", "z")]
    p2 = SSEParser()
    assert list(p2.feed("data: tail")) == []
    assert list(p2.close()) == [("message", "tail")]


def test_openai_ttft_skips_the_empty_role_chunk() -> None:
    lines = _timed(
        (10.2, _chunk({"role": "assistant"})),  # vllm-mlx / mlx_lm send this first
        (10.3, _chunk({"role": "assistant", "content": ""})),
        (10.5, _chunk({"content": "Hel"})),
        (10.7, _chunk({"content": "lo"})),
        (10.8, _chunk({}, usage={"prompt_tokens": 120, "completion_tokens": 2,
                                 "prompt_tokens_details": {"cached_tokens": 96}}, choices=False)),
        (10.9, "data: [DONE]"),
    )
    r = meter_lines("openai", lines, t0=10.0)
    assert r.ok and r.error is None
    assert r.ttft_s == pytest.approx(0.5)
    assert r.total_s == pytest.approx(0.9)
    assert (r.prompt_tokens, r.cached_tokens, r.completion_tokens) == (120, 96, 2)
    assert r.text == "Hello"


def test_openai_without_cached_details_reports_none_and_tool_call_counts_as_content() -> None:
    call = {"tool_calls": [{"index": 0, "function": {"name": "read_file", "arguments": ""}}]}
    lines = _timed((1.0, _chunk({"role": "assistant"})), (1.25, _chunk(call)),
                   (1.5, _chunk({}, usage={"prompt_tokens": 7, "completion_tokens": 1},
                                choices=False)))
    r = meter_lines("openai", lines, t0=0.75)
    assert r.ttft_s == pytest.approx(0.5)
    assert (r.prompt_tokens, r.cached_tokens) == (7, None)


def _anthropic(event: str, obj: dict) -> list[str]:
    return [f"event: {event}", "data: " + json.dumps({"type": event, **obj}), ""]


def test_anthropic_ttft_is_the_first_text_delta_and_usage_adds_up() -> None:
    start = {"message": {"id": "m", "role": "assistant", "content": [], "usage": {
        "input_tokens": 30, "cache_creation_input_tokens": 64,
        "cache_read_input_tokens": 512, "output_tokens": 0}}}
    script = [
        (0.05, _anthropic("message_start", start)),
        (0.06, _anthropic("content_block_start", {"index": 0, "content_block":
                                                  {"type": "text", "text": ""}})),
        (0.07, ["event: ping", 'data: {"type": "ping"}', ""]),
        (0.30, _anthropic("content_block_delta", {"index": 0, "delta":
                                                  {"type": "text_delta", "text": "Hi"}})),
        (0.40, _anthropic("content_block_stop", {"index": 0})),
        (0.41, _anthropic("message_delta", {"delta": {"stop_reason": "end_turn"},
                                            "usage": {"output_tokens": 5}})),
        (0.42, _anthropic("message_stop", {})),
    ]
    lines = [(t, line) for t, block in script for line in block]
    r = meter_lines("anthropic", lines, t0=0.0)
    assert r.ok
    assert r.ttft_s == pytest.approx(0.30)
    assert r.total_s == pytest.approx(0.42)
    assert (r.prompt_tokens, r.cached_tokens, r.completion_tokens) == (606, 512, 5)
    assert r.text == "Hi"


def test_stream_without_content_or_with_error_is_not_ok() -> None:
    r = meter_lines("openai", _timed((0.1, _chunk({"role": "assistant"})),
                                     (0.2, "data: [DONE]")), t0=0.0)
    assert not r.ok and r.ttft_s is None
    assert r.error == "stream ended without a content token"
    err = _timed((0.1, 'data: {"error": {"message": "context too long", "type": "invalid"}}'))
    r2 = meter_lines("openai", err, t0=0.0)
    assert not r2.ok and r2.error == "context too long"
    with pytest.raises(ValueError, match="api must be"):
        StreamMeter("grpc", 0.0)


def test_anthropic_body_converts_tool_calls_results_and_system() -> None:
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "task"},
        {"role": "assistant", "content": "<think>r</think>\nlook", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "list_dir", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "read_file", "content": "A"},
        {"role": "tool", "tool_call_id": "c2", "name": "list_dir", "content": "B"},
    ]
    tools = [{"type": "function", "function": {"name": "read_file", "description": "d",
                                               "parameters": {"type": "object"}}}]
    body = anthropic_body("m", messages, tools, 16)
    assert body["system"] == "sys"
    assert body["stream"] is True and body["max_tokens"] == 16 and body["temperature"] == 0.0
    assert body["tools"] == [{"name": "read_file", "description": "d",
                              "input_schema": {"type": "object"}}]
    assert body["messages"] == [
        {"role": "user", "content": "task"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "<think>r</think>\nlook"},
            {"type": "tool_use", "id": "c1", "name": "read_file", "input": {"path": "a.py"}},
            {"type": "tool_use", "id": "c2", "name": "list_dir", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "c1", "content": "A"},
            {"type": "tool_result", "tool_use_id": "c2", "content": "B"}]},
    ]
    with pytest.raises(ValueError, match="unknown message role"):
        anthropic_body("m", [{"role": "robot", "content": "x"}], [], 4)


def test_openai_body_asks_for_usage_in_the_stream() -> None:
    body = openai_body("m", [{"role": "user", "content": "x"}], [], 8)
    assert body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.0 and body["max_tokens"] == 8
    assert "tools" not in body
