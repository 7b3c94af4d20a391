"""Streaming OpenAI / Anthropic clients over httpx that measure TTFT.

TTFT is the time from sending the request to the first *content* token: an SSE chunk
that carries text (or reasoning, or a tool-call fragment). Chunks that carry only the
role (vllm-mlx and mlx_lm.server send ``{"delta": {"role": "assistant"}}`` first) or
Anthropic's ``message_start`` / ``content_block_start`` do not count.

The SSE parsing and metering are pure (``SSEParser``, ``StreamMeter``) so they are
tested on canned streams; ``send_turn`` does the HTTP.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import httpx

log = logging.getLogger(__name__)


@dataclass
class TurnResult:
    ok: bool = False
    ttft_s: float | None = None
    total_s: float | None = None
    prompt_tokens: int | None = None  # all prompt tokens, cached or not
    cached_tokens: int | None = None  # None: the system did not report it
    completion_tokens: int | None = None
    text: str = ""
    error: str | None = None
    api: str = "openai"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class SSEParser:
    """Server-sent events from text lines: yields ``(event, data)`` per dispatched event."""

    def __init__(self) -> None:
        self._event = ""
        self._data: list[str] = []

    def feed(self, line: str) -> Iterator[tuple[str, str]]:
        line = line.rstrip("\r\n")
        if not line:
            yield from self._dispatch()
            return
        if line.startswith(":"):
            return  # comment / keep-alive
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)

    def close(self) -> Iterator[tuple[str, str]]:
        yield from self._dispatch()

    def _dispatch(self) -> Iterator[tuple[str, str]]:
        if self._data:
            yield self._event or "message", "\n".join(self._data)
        self._event = ""
        self._data = []


class StreamMeter:
    """Folds the events of one streamed response into a ``TurnResult``."""

    def __init__(self, api: str, t0: float) -> None:
        if api not in ("openai", "anthropic"):
            raise ValueError(f"api must be 'openai' or 'anthropic', got {api!r}")
        self.api = api
        self.t0 = t0
        self.result = TurnResult(api=api)
        self._parts: list[str] = []
        self._done = False

    def feed(self, event: str, data: str, t: float) -> None:
        if data.strip() == "[DONE]":
            self._done = True
            return
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            log.debug("non-JSON SSE data ignored: %.80s", data)
            return
        if not isinstance(obj, dict):
            return
        if "error" in obj and obj.get("type") in (None, "error"):
            err = obj["error"]
            self.result.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return
        if self.api == "openai":
            self._feed_openai(obj, t)
        else:
            self._feed_anthropic(event if event != "message" else str(obj.get("type", "")), obj, t)

    def _content(self, piece: str, t: float) -> None:
        if piece and self.result.ttft_s is None:
            self.result.ttft_s = t - self.t0
        self._parts.append(piece)

    def _feed_openai(self, obj: dict[str, Any], t: float) -> None:
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            for key in ("content", "reasoning_content", "reasoning"):
                piece = delta.get(key)
                if isinstance(piece, str) and piece:
                    self._content(piece, t)
            for call in delta.get("tool_calls") or ():
                args = (call.get("function") or {}).get("arguments") or ""
                name = (call.get("function") or {}).get("name") or ""
                if args or name:
                    self._content(name + args, t)
            if isinstance(choice.get("text"), str) and choice["text"]:  # /v1/completions
                self._content(choice["text"], t)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.result.prompt_tokens = usage.get("prompt_tokens")
            self.result.completion_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and details.get("cached_tokens") is not None:
                self.result.cached_tokens = int(details["cached_tokens"])

    def _feed_anthropic(self, event: str, obj: dict[str, Any], t: float) -> None:
        if event == "message_start":
            self._anthropic_usage((obj.get("message") or {}).get("usage"))
        elif event == "content_block_delta":
            delta = obj.get("delta") or {}
            for key in ("text", "thinking", "partial_json"):
                piece = delta.get(key)
                if isinstance(piece, str) and piece:
                    self._content(piece, t)
        elif event == "message_delta":
            self._anthropic_usage(obj.get("usage"))
        elif event == "message_stop":
            self._done = True

    def _anthropic_usage(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        if "input_tokens" in usage:
            read = usage.get("cache_read_input_tokens")
            created = usage.get("cache_creation_input_tokens") or 0
            self.result.prompt_tokens = int(usage["input_tokens"]) + int(read or 0) + int(created)
            if read is not None:
                self.result.cached_tokens = int(read)
        if "output_tokens" in usage:
            self.result.completion_tokens = int(usage["output_tokens"])

    def finish(self, t: float) -> TurnResult:
        r = self.result
        r.total_s = t - self.t0
        r.text = "".join(self._parts)
        r.ok = r.error is None and r.ttft_s is not None
        if r.error is None and r.ttft_s is None:
            r.error = "stream ended without a content token"
        return r


def meter_lines(api: str, timed_lines: Iterable[tuple[float, str]], t0: float) -> TurnResult:
    """A ``TurnResult`` from ``(arrival_time, line)`` pairs (the canned-stream entry point)."""
    parser, meter = SSEParser(), StreamMeter(api, t0)
    t = t0
    for t, line in timed_lines:
        for event, data in parser.feed(line):
            meter.feed(event, data, t)
    for event, data in parser.close():
        meter.feed(event, data, t)
    return meter.finish(t)


# --- request bodies -------------------------------------------------------------------


def openai_body(model: str, messages: Iterable[dict[str, Any]], tools: Iterable[dict[str, Any]],
                max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [dict(m) for m in messages],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tools = list(tools)
    if tools:
        body["tools"] = tools
    return body


def anthropic_body(model: str, messages: Iterable[dict[str, Any]], tools: Iterable[dict[str, Any]],
                   max_tokens: int) -> dict[str, Any]:
    """OpenAI-format history -> an Anthropic Messages request (tool calls as blocks)."""
    system: list[str] = []
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "system":
            system.append(str(m.get("content") or ""))
        elif role == "user":
            out.append({"role": "user", "content": str(m.get("content") or "")})
        elif role == "assistant":
            blocks: list[dict[str, Any]] = []
            if m.get("content"):
                blocks.append({"type": "text", "text": str(m["content"])})
            for call in m.get("tool_calls") or ():
                fn = call.get("function") or {}
                blocks.append({"type": "tool_use", "id": call["id"], "name": fn.get("name", ""),
                               "input": json.loads(fn.get("arguments") or "{}")})
            out.append({"role": "assistant", "content": blocks})
        elif role == "tool":
            block = {"type": "tool_result", "tool_use_id": m.get("tool_call_id", ""),
                     "content": str(m.get("content") or "")}
            if out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], list):
                out[-1]["content"].append(block)  # consecutive results: one user turn
            else:
                out.append({"role": "user", "content": [block]})
        else:
            raise ValueError(f"unknown message role {role!r}")
    body: dict[str, Any] = {"model": model, "messages": out, "max_tokens": max_tokens,
                            "temperature": 0.0, "stream": True}
    if system:
        body["system"] = "\n\n".join(system)
    tool_list = [
        {"name": t["function"]["name"], "description": t["function"].get("description", ""),
         "input_schema": t["function"].get("parameters", {"type": "object"})}
        for t in tools
    ]
    if tool_list:
        body["tools"] = tool_list
    return body


def send_turn(client: httpx.Client, base_url: str, api: str, model: str,
              messages: Iterable[dict[str, Any]], tools: Iterable[dict[str, Any]] = (),
              max_tokens: int = 16, timeout_s: float = 600.0) -> TurnResult:
    """Send one streamed request and meter it; never raises for HTTP / network errors."""
    if api == "openai":
        url, body = f"{base_url}/v1/chat/completions", openai_body(model, messages, tools, max_tokens)
        headers = {}
    elif api == "anthropic":
        url, body = f"{base_url}/v1/messages", anthropic_body(model, messages, tools, max_tokens)
        headers = {"anthropic-version": "2023-06-01", "x-api-key": "bench"}
    else:
        raise ValueError(f"api must be 'openai' or 'anthropic', got {api!r}")
    parser, meter = SSEParser(), StreamMeter(api, time.perf_counter())
    try:
        with client.stream("POST", url, json=body, headers=headers, timeout=timeout_s) as resp:
            if resp.status_code != 200:
                resp.read()
                meter.result.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
                return meter.finish(time.perf_counter())
            for line in resp.iter_lines():
                t = time.perf_counter()
                for event, data in parser.feed(line):
                    meter.feed(event, data, t)
            for event, data in parser.close():
                meter.feed(event, data, time.perf_counter())
    except httpx.HTTPError as e:
        meter.result.error = f"{type(e).__name__}: {e}"
    return meter.finish(time.perf_counter())
