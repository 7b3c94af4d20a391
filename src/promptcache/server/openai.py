"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..engine.api import GenerationResult
from .errors import APIError, error_body
from .prompt import openai_messages, openai_tools
from .runner import Generation, ServerState, final_tail
from .schemas import ChatCompletionRequest, CompletionRequest
from .toolcalls import ToolCall, ToolCallStream, offered_tool_names, parse_tool_calls

router = APIRouter()

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def state_of(request: Request) -> ServerState:
    st: ServerState = request.app.state.pc
    return st


def render_messages(st: ServerState, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None) -> tuple[list[int], list[int]]:
    """Chat template -> (tokens, message start offsets). Template failures are 400s."""
    engine = st.engine
    try:
        with_offsets = getattr(engine, "render_chat_with_offsets", None)
        if with_offsets is not None:
            tokens, starts = with_offsets(messages, tools=tools)
            return list(tokens), list(starts)
        return list(engine.render_chat(messages, tools=tools)), []
    except ValueError:
        raise
    except Exception as e:  # jinja TemplateError & co: caused by the request's messages
        raise APIError(400, f"cannot render the chat template for these messages: {e}",
                       code="invalid_messages", param="messages") from e


def openai_usage(result: GenerationResult) -> dict[str, Any]:
    u = result.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def _finish_reason(result: GenerationResult, calls: tuple[ToolCall, ...] = ()) -> str:
    if calls:
        return "tool_calls"
    return "length" if result.finish_reason == "length" else "stop"


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_dicts(calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
    """``message.tool_calls`` of a chat completion (arguments as a JSON string)."""
    return [{"id": _call_id(), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments_json}} for c in calls]


def tool_call_deltas(calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
    """Streaming deltas: per call, one with id/type/name (arguments ""), then the arguments."""
    deltas: list[dict[str, Any]] = []
    for i, c in enumerate(calls):
        deltas.append({"tool_calls": [{"index": i, "id": _call_id(), "type": "function",
                                       "function": {"name": c.name, "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": i,
                                       "function": {"arguments": c.arguments_json}}]})
    return deltas


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _engine_failed(result: GenerationResult) -> APIError:
    return APIError(500, f"generation failed: {result.error or 'engine error'}",
                    code="engine_error")


async def _stream(gen: Generation, make_chunk: Any, first: dict[str, Any] | None,
                  include_usage: bool, path: str,
                  parser: ToolCallStream | None = None) -> AsyncIterator[str]:
    """OpenAI SSE: chunks, a final chunk with finish_reason, optional usage, [DONE].

    With a tool-call ``parser`` (chat completions offering tools), text goes through
    it and the calls it finds are sent as ``delta.tool_calls`` chunks at the end."""
    if first is not None:
        yield _sse(make_chunk(first, None, include_usage))
    streamed: list[str] = []
    async for ev in gen.events():
        if isinstance(ev, GenerationResult):
            if ev.finish_reason == "error":
                yield _sse(error_body(path, 500, f"generation failed: {ev.error}",
                                      "engine_error"))
                break
            tail, calls = final_tail("".join(streamed), ev, parser)
            if tail:
                yield _sse(make_chunk(tail, None, include_usage))
            for delta in tool_call_deltas(calls):
                yield _sse(make_chunk(delta, None, include_usage))
            yield _sse(make_chunk(None, _finish_reason(ev, calls), include_usage))
            if include_usage:
                chunk = make_chunk(None, None, False)
                chunk["choices"] = []
                chunk["usage"] = openai_usage(ev)
                yield _sse(chunk)
            break
        if ev.text:
            streamed.append(ev.text)
            text = parser.feed(ev.text) if parser is not None else ev.text
            if text:
                yield _sse(make_chunk(text, None, include_usage))
    yield "data: [DONE]\n\n"


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    st = state_of(request)
    model = st.check_model(body.model)
    if body.n not in (None, 1):
        raise APIError(400, "only n=1 is supported", param="n")
    if (body.model_extra or {}).get("logprobs"):
        raise APIError(400, "logprobs are not supported", param="logprobs")
    messages = openai_messages(body.messages)
    tools = openai_tools(body.tools) if body.tool_choice != "none" else None
    tool_names = offered_tool_names(tools)
    prompt, starts = render_messages(st, messages, tools)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    max_tokens = st.max_tokens_for(requested, len(prompt))
    sampling = st.sampling(max_tokens=max_tokens, temperature=body.temperature,
                           top_p=body.top_p, seed=body.seed, stop=body.stop)
    gen = st.start("openai", request, request.state.pc_scope, prompt, sampling, starts)
    cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def make_chunk(content: Any, finish: str | None, with_usage: bool) -> dict[str, Any]:
            delta: dict[str, Any] = {}
            if isinstance(content, dict):
                delta = content
            elif content is not None:
                delta = {"content": content}
            chunk: dict[str, Any] = {
                "id": cid, "object": "chat.completion.chunk", "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": finish}],
            }
            if with_usage:
                chunk["usage"] = None
            return chunk

        return StreamingResponse(
            _stream(gen, make_chunk, {"role": "assistant", "content": ""}, include_usage,
                    request.url.path, ToolCallStream(tool_names) if tool_names else None),
            media_type="text/event-stream", headers=SSE_HEADERS)

    text, result = await gen.collect()
    if result.finish_reason == "error":
        raise _engine_failed(result)
    parsed = parse_tool_calls(text, tool_names)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.text}
    if parsed.tool_calls:
        message["content"] = parsed.text or None
        message["tool_calls"] = tool_call_dicts(parsed.tool_calls)
    return JSONResponse({
        "id": cid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": _finish_reason(result, parsed.tool_calls)}],
        "usage": openai_usage(result),
    })


def _completion_prompt(st: ServerState, prompt: str | list[str] | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return list(st.engine.tokenizer.encode(prompt))
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt")
        return list(st.engine.tokenizer.encode(prompt[0]))
    tokens = [int(t) for t in prompt]
    vocab = getattr(st.engine, "vocab_size", None)
    for t in tokens:
        if t < 0 or (vocab is not None and t >= vocab):
            raise APIError(400, f"prompt token id {t} is out of range", param="prompt")
    return tokens


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    st = state_of(request)
    model = st.check_model(body.model)
    if body.n not in (None, 1):
        raise APIError(400, "only n=1 is supported", param="n")
    prompt = _completion_prompt(st, body.prompt)
    max_tokens = st.max_tokens_for(body.max_tokens, len(prompt))
    sampling = st.sampling(max_tokens=max_tokens, temperature=body.temperature,
                           top_p=body.top_p, seed=body.seed, stop=body.stop)
    gen = st.start("openai", request, request.state.pc_scope, prompt, sampling)
    cid = f"cmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    echo = body.prompt if (body.echo and isinstance(body.prompt, str)) else ""

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def make_chunk(text: Any, finish: str | None, with_usage: bool) -> dict[str, Any]:
            chunk: dict[str, Any] = {
                "id": cid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text or "", "logprobs": None,
                             "finish_reason": finish}],
            }
            if with_usage:
                chunk["usage"] = None
            return chunk

        return StreamingResponse(
            _stream(gen, make_chunk, None, include_usage, request.url.path),
            media_type="text/event-stream", headers=SSE_HEADERS)

    text, result = await gen.collect()
    if result.finish_reason == "error":
        raise _engine_failed(result)
    return JSONResponse({
        "id": cid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": echo + text, "logprobs": None,
                     "finish_reason": _finish_reason(result)}],
        "usage": openai_usage(result),
    })


def _model_card(st: ServerState, model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": int(st.started_at),
            "owned_by": "promptcache"}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    st = state_of(request)
    return {"object": "list", "data": [_model_card(st, st.model_id)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    st = state_of(request)
    st.check_model(model_id)
    return _model_card(st, st.model_id)
