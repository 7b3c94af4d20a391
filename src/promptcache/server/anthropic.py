"""Anthropic-compatible endpoints: /v1/messages (streaming and not), /v1/messages/count_tokens.

Usage accounting (all counts are prompt tokens of this request):
- ``cache_read_input_tokens``: tokens restored from the cache;
- ``cache_creation_input_tokens``: uncached tokens this request wrote to the cache
  (its uncached prompt tokens when it saved prompt blocks, else 0);
- ``input_tokens``: uncached tokens that were not written to the cache.
The three are disjoint, as in Anthropic's API: ``input_tokens +
cache_creation_input_tokens + cache_read_input_tokens == prompt tokens`` (clients such
as Claude Code add them up to size the context). The uncached part of the prompt is
``input_tokens + cache_creation_input_tokens``.

Streaming: ``message_start`` is sent at once; its usage is a prediction from a pure
cache lookup (the engine reports exact numbers only at the end). The exact usage is in
``message_delta`` (the SDKs take the latest values).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..engine.api import GenerationResult
from .errors import APIError
from .openai import SSE_HEADERS, render_messages, state_of
from .prompt import anthropic_messages, anthropic_tools
from .runner import Generation, ServerState, cache_creation_tokens, final_tail
from .schemas import CountTokensRequest, MessagesRequest
from .toolcalls import ToolCall, ToolCallStream, offered_tool_names, parse_tool_calls

log = logging.getLogger(__name__)
router = APIRouter()


def anthropic_usage(result: GenerationResult) -> dict[str, int]:
    u = result.usage
    created = cache_creation_tokens(result)
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens - created,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": u.completion_tokens,
    }


def _stop(result: GenerationResult, calls: tuple[ToolCall, ...] = ()) -> dict[str, Any]:
    """``stop_reason`` and ``stop_sequence`` of a finished reply."""
    if calls:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if result.finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if result.stop_sequence is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": result.stop_sequence}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call.name,
            "input": call.arguments}


def content_blocks(text: str, calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
    """[text?, tool_use...]: the text block is left out when empty and there are calls."""
    blocks: list[dict[str, Any]] = []
    if text or not calls:
        blocks.append({"type": "text", "text": text})
    blocks.extend(_tool_use(c) for c in calls)
    return blocks


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def _predicted_cached(st: ServerState, prompt: list[int], tenant: str) -> int:
    cache = getattr(st.engine, "cache", None)
    if cache is None:
        return 0
    try:
        match = cache.lookup(prompt, st.engine.namespace(tenant))
        return max(0, min(int(match.num_tokens), len(prompt) - 1))
    except Exception:  # a prediction only; never fails the request
        log.debug("cache lookup for the usage prediction failed", exc_info=True)
        return 0


def _text_delta(index: int, text: str) -> str:
    return _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                          "delta": {"type": "text_delta", "text": text}})


def _tool_use_events(index: int, call: ToolCall) -> list[str]:
    block = _tool_use(call)
    block["input"] = {}
    return [
        _event("content_block_start", {"type": "content_block_start", "index": index,
                                       "content_block": block}),
        _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                       "delta": {"type": "input_json_delta",
                                                 "partial_json": call.arguments_json}}),
        _event("content_block_stop", {"type": "content_block_stop", "index": index}),
    ]


async def _stream(gen: Generation, msg_id: str, model: str, prompt_len: int,
                  predicted: int, caching: bool,
                  parser: ToolCallStream | None = None) -> AsyncIterator[str]:
    """The event sequence. Without tools the text block (index 0) opens at once; with a
    tool-call ``parser`` it opens at the first text (a reply that only calls tools has
    no text block) and the tool_use blocks follow it at the end."""
    created = (prompt_len - predicted) if caching else 0
    start_usage = {"input_tokens": prompt_len - predicted - created,
                   "cache_creation_input_tokens": created,
                   "cache_read_input_tokens": predicted, "output_tokens": 0}
    yield _event("message_start", {"type": "message_start", "message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": start_usage}})
    text_open = False

    def open_text() -> str:
        nonlocal text_open
        text_open = True
        return _event("content_block_start", {"type": "content_block_start", "index": 0,
                                              "content_block": {"type": "text", "text": ""}})

    if parser is None:
        yield open_text()
    yield _event("ping", {"type": "ping"})
    streamed: list[str] = []
    async for ev in gen.events():
        if isinstance(ev, GenerationResult):
            if ev.finish_reason == "error":
                yield _event("error", {"type": "error", "error": {
                    "type": "api_error", "message": f"generation failed: {ev.error}"}})
                return
            tail, calls = final_tail("".join(streamed), ev, parser)
            if (tail or not calls) and not text_open:
                yield open_text()
            if tail:
                yield _text_delta(0, tail)
            if text_open:
                yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
            first = 1 if text_open else 0
            for i, call in enumerate(calls):
                for event in _tool_use_events(first + i, call):
                    yield event
            yield _event("message_delta", {"type": "message_delta", "delta": _stop(ev, calls),
                                           "usage": anthropic_usage(ev)})
            yield _event("message_stop", {"type": "message_stop"})
            return
        if ev.text:
            streamed.append(ev.text)
            text = parser.feed(ev.text) if parser is not None else ev.text
            if text:
                if not text_open:
                    yield open_text()
                yield _text_delta(0, text)


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request) -> Any:
    st = state_of(request)
    model = st.check_model(body.model)
    msgs = anthropic_messages(body.messages, body.system)
    tools = anthropic_tools(body.tools)
    if body.tool_choice and body.tool_choice.get("type") == "none":
        tools = None
    tool_names = offered_tool_names(tools)
    prompt, starts = render_messages(st, msgs, tools)
    max_tokens = st.max_tokens_for(body.max_tokens, len(prompt))
    if body.temperature is not None and not 0.0 <= body.temperature <= 1.0:
        raise APIError(400, f"temperature must be in [0, 1], got {body.temperature}",
                       param="temperature")
    sampling = st.sampling(max_tokens=max_tokens, temperature=body.temperature,
                           top_p=body.top_p, seed=None, stop=body.stop_sequences)
    scope = request.state.pc_scope
    predicted = _predicted_cached(st, prompt, scope.tenant) if body.stream else 0
    gen = st.start("anthropic", request, scope, prompt, sampling, starts)
    msg_id = f"msg_{uuid.uuid4().hex[:24]}"
    if body.stream:
        caching = getattr(st.engine, "cache", None) is not None
        parser = ToolCallStream(tool_names) if tool_names else None
        return StreamingResponse(_stream(gen, msg_id, model, len(prompt), predicted, caching,
                                         parser),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    text, result = await gen.collect()
    if result.finish_reason == "error":
        raise APIError(500, f"generation failed: {result.error or 'engine error'}")
    parsed = parse_tool_calls(text, tool_names)
    return JSONResponse({
        "id": msg_id, "type": "message", "role": "assistant", "model": model,
        "content": content_blocks(parsed.text, parsed.tool_calls),
        **_stop(result, parsed.tool_calls),
        "usage": anthropic_usage(result),
    })


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    st = state_of(request)
    st.check_model(body.model)
    msgs = anthropic_messages(body.messages, body.system)
    prompt, _ = render_messages(st, msgs, anthropic_tools(body.tools))
    return {"input_tokens": len(prompt)}
