"""Checkers of the three streaming protocols: each asserts the event sequence and
returns what a client would assemble from it."""

from __future__ import annotations

import json
from typing import Any

from server_helpers import sse_events


def anthropic_stream(text: str) -> dict[str, Any]:
    """message_start, ping(s), blocks opened / delta'd / closed in index order,
    message_delta, message_stop -> {"content", "stop", "usage", "start_usage", "pings"}."""
    events = sse_events(text)
    names = [n for n, _ in events]
    assert names[0] == "message_start", names
    assert names[-2:] == ["message_delta", "message_stop"], names
    assert all(d["type"] == n for n, d in events)
    blocks: list[dict[str, Any]] = []
    open_index: int | None = None
    partial = ""
    pings = 0
    for name, data in events[1:-2]:
        if name == "ping":
            pings += 1
        elif name == "content_block_start":
            assert open_index is None and data["index"] == len(blocks), (name, data)
            open_index = data["index"]
            blocks.append(dict(data["content_block"]))
            partial = ""
        elif name == "content_block_delta":
            assert data["index"] == open_index, (name, data)
            block, delta = blocks[-1], data["delta"]
            kind = delta["type"]
            if kind == "text_delta":
                assert block["type"] == "text"
                block["text"] += delta["text"]
            elif kind == "thinking_delta":
                assert block["type"] == "thinking"
                block["thinking"] += delta["thinking"]
            elif kind == "signature_delta":
                assert block["type"] == "thinking"
                block["signature"] += delta["signature"]
            elif kind == "input_json_delta":
                assert block["type"] == "tool_use"
                partial += delta["partial_json"]
            else:
                raise AssertionError(f"unknown delta {kind}")
        elif name == "content_block_stop":
            assert data["index"] == open_index
            if blocks[-1]["type"] == "tool_use":
                blocks[-1]["input"] = json.loads(partial) if partial else {}
            open_index = None
        else:
            raise AssertionError(f"unexpected event {name}")
    assert open_index is None
    return {"content": blocks, "stop": events[-2][1]["delta"], "usage": events[-2][1]["usage"],
            "start_usage": events[0][1]["message"]["usage"], "pings": pings}


def responses_stream(text: str) -> dict[str, Any]:
    """response.created, response.in_progress, items added -> parts -> deltas -> done,
    and a terminal response.completed / .incomplete whose output equals the items
    announced as done; sequence numbers 0, 1, 2, ... -> the final response (plus
    "comments": the number of keep-alive comments)."""
    comments = text.count(": keep-alive\n\n")
    events = sse_events(text.replace(": keep-alive\n\n", ""))
    data = [d for _, d in events]
    assert all(n == d["type"] for n, d in events)
    types = [d["type"] for d in data]
    assert types[:2] == ["response.created", "response.in_progress"], types
    assert types[-1] in ("response.completed", "response.incomplete"), types
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    done: list[dict[str, Any]] = []
    added: list[dict[str, Any]] = []
    texts: dict[int, str] = {}
    args: dict[int, str] = {}
    for d in data[2:-1]:
        t = d["type"]
        if t == "response.output_item.added":
            assert d["output_index"] == len(added) == len(done)
            added.append(d["item"])
        elif t in ("response.output_text.delta", "response.reasoning_text.delta"):
            assert d["output_index"] == len(added) - 1
            assert d["item_id"] == added[-1]["id"]
            texts[d["output_index"]] = texts.get(d["output_index"], "") + d["delta"]
        elif t in ("response.output_text.done", "response.reasoning_text.done"):
            assert d["text"] == texts.get(d["output_index"], "")
        elif t == "response.function_call_arguments.delta":
            args[d["output_index"]] = args.get(d["output_index"], "") + d["delta"]
        elif t == "response.function_call_arguments.done":
            assert d["arguments"] == args[d["output_index"]]
        elif t == "response.output_item.done":
            assert d["output_index"] == len(done) == len(added) - 1
            assert d["item"]["id"] == added[-1]["id"]
            done.append(d["item"])
        else:
            assert t in ("response.content_part.added", "response.content_part.done"), t
    final = dict(data[-1]["response"])
    assert final["output"] == done
    assert data[0]["response"]["id"] == final["id"]
    final["comments"] = comments
    return final


def chat_stream(text: str) -> dict[str, Any]:
    """chunks of one id, the role first, one finish_reason, optional usage chunk, [DONE]
    -> {"content", "reasoning", "tool_calls", "finish_reason", "usage", "logprobs",
    "comments"}."""
    comments = text.count(": keep-alive\n\n")
    events = sse_events(text.replace(": keep-alive\n\n", ""))
    assert events[-1] == (None, "[DONE]")
    chunks = [d for _, d in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content, reasoning, finish, usage = "", "", None, None
    calls: dict[int, dict[str, Any]] = {}
    logprobs: list[dict[str, Any]] = []
    for c in chunks:
        if c.get("usage"):
            assert c["choices"] == []
            usage = c["usage"]
            continue
        choice = c["choices"][0]
        assert finish is None, "a chunk after the finish_reason"
        delta = choice["delta"]
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning_content") or ""
        for tc in delta.get("tool_calls", []):
            slot = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            slot["id"] = tc.get("id") or slot["id"]
            fn = tc.get("function", {})
            slot["name"] = fn.get("name") or slot["name"]
            slot["arguments"] += fn.get("arguments", "")
        if choice.get("logprobs"):
            logprobs += choice["logprobs"]["content"]
        finish = choice["finish_reason"]
    assert finish is not None
    return {"content": content, "reasoning": reasoning,
            "tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": finish,
            "usage": usage, "logprobs": logprobs, "comments": comments}


def assert_one_call_in_every_api(client: Any, tools: dict[str, Any], want: tuple[str, Any],
                                 text: str, stream: bool, max_tokens: int = 400) -> None:
    """One chat, Messages and Responses request each (``tools``: the tools in each API's
    shape, keys "chat", "messages", "responses"); every reply is ``text`` then exactly
    the call ``want`` = (name, arguments), streamed or whole."""
    hi = [{"role": "user", "content": "Hi"}]
    r = client.post("/v1/chat/completions", json={"messages": hi, "tools": tools["chat"],
                                                  "max_tokens": max_tokens, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        got = chat_stream(r.text)
        [call] = got["tool_calls"]
        assert (call["name"], json.loads(call["arguments"])) == want
        assert got["content"] == text and got["finish_reason"] == "tool_calls"
    else:
        msg = r.json()["choices"][0]["message"]
        [tc] = msg["tool_calls"]
        assert (tc["function"]["name"], json.loads(tc["function"]["arguments"])) == want
        assert msg["content"] == text
    r = client.post("/v1/messages", json={"messages": hi, "tools": tools["messages"],
                                          "max_tokens": max_tokens, "stream": stream})
    blocks = (anthropic_stream(r.text) if stream else r.json())["content"]
    assert blocks[0] == {"type": "text", "text": text}
    assert [(b["name"], b["input"]) for b in blocks[1:]] == [want]
    r = client.post("/v1/responses", json={"input": "go", "tools": tools["responses"],
                                           "max_output_tokens": max_tokens, "stream": stream})
    final = responses_stream(r.text) if stream else r.json()
    message, call = final["output"]
    assert message["content"][0]["text"] == text
    assert (call["type"], call["name"], json.loads(call["arguments"])) == ("function_call",
                                                                           *want)
