"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models: reasoning
as ``reasoning_content``, tool calls in the model's own format, constrained decoding for
``response_format`` / forced ``tool_choice``, logprobs, ``logit_bias``, assistant prefill
(the parameters' checks: ``openai_params.py``; docs/api.md)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ...engine.api import GenerationResult, TokenEvent
from ..prompts.images import ImageCollector
from ..prompts.prepared import ChatPrompt, TurnContext
from ..prompts.preparer import preparer_of
from ..prompts.prompt import openai_messages, openai_tools
from ..prompts.structured import openai_response_format, openai_tool_choice
from ..prompts.turns import (
    after_reply,
    context_window,
    max_output_tokens,
    plan_max_tokens,
    retention_of,
    start,
)
from ..replies.reasoning import Piece, ReplyParser
from ..replies.reply import (
    KEEPALIVE,
    SSE_COMMENT,
    SSE_HEADERS,
    Finished,
    LogprobDecoder,
    Sleep,
    collect_reply,
    reply_events,
    reply_parser,
    sleep_of,
    sse_data,
)
from ..replies.runner import Generation, ServerState, state_of
from ..replies.toolcalls import ToolCall, offered_tool_names
from . import openai_params
from .errors import APIError, error_body
from .schemas import ChatCompletionRequest, CompletionRequest, OAIMessage, OAIToolCall

router = APIRouter()


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


def tool_call_dicts(calls: tuple[ToolCall, ...], ids: list[str] | None = None
                    ) -> list[dict[str, Any]]:
    """``message.tool_calls`` of a chat completion (arguments as a JSON string)."""
    ids = ids or [_call_id() for _ in calls]
    return [{"id": cid, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments_json}}
            for cid, c in zip(ids, calls, strict=True)]


def tool_call_deltas(calls: tuple[ToolCall, ...], ids: list[str] | None = None
                     ) -> list[dict[str, Any]]:
    """Streaming deltas: per call, one with id/type/name (arguments ""), then the arguments."""
    ids = ids or [_call_id() for _ in calls]
    deltas: list[dict[str, Any]] = []
    for i, c in enumerate(calls):
        deltas.append({"tool_calls": [{"index": i, "id": ids[i], "type": "function",
                                       "function": {"name": c.name, "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": i,
                                       "function": {"arguments": c.arguments_json}}]})
    return deltas


def _engine_failed(result: GenerationResult) -> APIError:
    return APIError(500, f"generation failed: {result.error or 'engine error'}",
                    code="engine_error")


def _thinking_switch(effort: str | None) -> bool | None:
    """Chat ``reasoning_effort`` -> the template's thinking switch (None: its default)."""
    if effort is None:
        return None
    return effort not in ("none", "minimal")


def _logprobs_k(logprobs: bool | None, top: int | None) -> int | None:
    if not logprobs:
        if top:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return None
    if top is not None and not 0 <= top <= 20:
        raise APIError(400, f"top_logprobs must be in [0, 20], got {top}", param="top_logprobs")
    return top or 0


def echo_messages(text: str, calls: tuple[ToolCall, ...], ids: list[str]
                  ) -> list[dict[str, Any]]:
    """A reply as the next request carries it (no reasoning_content), read by this parser."""
    msg = OAIMessage(role="assistant", content=text or None,
                     tool_calls=[OAIToolCall.model_validate(t)
                                 for t in tool_call_dicts(calls, ids)] or None)
    return openai_messages([msg])


async def _chat_stream(gen: Generation, parser: ReplyParser, st: ServerState,
                       make_chunk: Any, include_usage: bool, path: str,
                       decoder: LogprobDecoder | None, sleep: Sleep,
                       on_reply: Callable[[list[dict[str, Any]]], None]
                       ) -> AsyncIterator[str]:
    yield sse_data(make_chunk({"role": "assistant", "content": ""}))
    pending: list[TokenEvent] = []  # logprobs travel with the next chunk

    async def chunk(delta: dict[str, Any] | None, finish: str | None = None) -> str:
        logprobs = None
        if decoder is not None and pending:
            logprobs = {"content": await decoder.entries(pending), "refusal": None}
            pending.clear()
        return sse_data(make_chunk(delta, finish, logprobs))

    async for ev in reply_events(gen, parser, keepalive_s=st.config.keepalive_s, sleep=sleep):
        if ev is KEEPALIVE:
            yield SSE_COMMENT
        elif isinstance(ev, TokenEvent):
            pending.append(ev)
        elif isinstance(ev, Piece):
            key = "reasoning_content" if ev.kind == "reasoning" else "content"
            yield await chunk({key: ev.text})
        elif isinstance(ev, Finished):
            if ev.failed:
                yield sse_data(error_body(path, 500, f"generation failed: {ev.result.error}",
                                          "engine_error"))
                break
            ids = [_call_id() for _ in ev.tool_calls]
            for delta in tool_call_deltas(ev.tool_calls, ids):
                yield await chunk(delta)
            on_reply(echo_messages(ev.text, ev.tool_calls, ids))
            yield await chunk({}, _finish_reason(ev.result, ev.tool_calls))
            if include_usage:
                last = make_chunk(None)
                last["choices"] = []
                last["usage"] = openai_usage(ev.result)
                yield sse_data(last)
            break
    yield "data: [DONE]\n\n"


def chat_prompt(body: ChatCompletionRequest, images: ImageCollector | None = None
                ) -> ChatPrompt:
    """The request as a ``ChatPrompt`` (also what ``/v1/cache/probe`` renders)."""
    messages = openai_messages(body.messages, images)
    tools = openai_tools(body.tools) if body.tool_choice != "none" else None
    structure = openai_tool_choice(body.tool_choice, offered_tool_names(tools),
                                   body.parallel_tool_calls) \
        or openai_response_format(body.response_format)
    return ChatPrompt(messages, tools, _thinking_switch(body.reasoning_effort), images=images,
                      structure=structure, source=body, retention=retention_of(body))


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    st = state_of(request)
    model = st.check_model(body.model)
    if body.n not in (None, 1):
        raise APIError(400, "only n=1 is supported", param="n")
    k = _logprobs_k(body.logprobs, body.top_logprobs)
    bias = openai_params.logit_bias(body.logit_bias, st.engine.vocab_size)
    scope = request.state.pc_scope.with_session(body.prompt_cache_key, "prompt_cache_key")
    turn = TurnContext.of(scope)
    chat = chat_prompt(body, st.image_collector())
    prepared = await preparer_of(request).prepare(chat, turn=turn, generate=True)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = plan_max_tokens(st, "openai", len(prepared.tokens), requested, param)
    sampling = st.sampling(max_tokens=max_tokens, temperature=body.temperature,
                           top_p=body.top_p, seed=body.seed, stop=body.stop, logprobs=k,
                           logit_bias=bias, penalties=openai_params.penalties(body))
    gen = start(st, "openai", request, scope, prepared, sampling, turn)

    def on_reply(reply: list[dict[str, Any]]) -> None:
        after_reply(request, gen, turn, prepared, chat, reply)
    parser = reply_parser(prepared)
    decoder = (LogprobDecoder(st.engine.tokenizer, sampling.stop_token_ids)
               if k is not None else None)
    cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def make_chunk(delta: dict[str, Any] | None, finish: str | None = None,
                       logprobs: Any = None) -> dict[str, Any]:
            chunk: dict[str, Any] = {
                "id": cid, "object": "chat.completion.chunk", "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta or {}, "logprobs": logprobs,
                             "finish_reason": finish}],
            }
            if include_usage:
                chunk["usage"] = None
            return chunk

        return StreamingResponse(
            _chat_stream(gen, parser, st, make_chunk, include_usage, request.url.path,
                         decoder, sleep_of(request), on_reply),
            media_type="text/event-stream", headers=SSE_HEADERS)

    finished, token_events = await collect_reply(gen, parser)
    if finished.failed:
        raise _engine_failed(finished.result)
    message: dict[str, Any] = {"role": "assistant", "content": finished.text}
    if finished.reasoning:
        message["reasoning_content"] = finished.reasoning
    ids = [_call_id() for _ in finished.tool_calls]
    on_reply(echo_messages(finished.text, finished.tool_calls, ids))
    if finished.tool_calls:
        message["content"] = finished.text or None
        message["tool_calls"] = tool_call_dicts(finished.tool_calls, ids)
    logprobs = None
    if decoder is not None:
        logprobs = {"content": await decoder.entries(token_events), "refusal": None}
    return JSONResponse({
        "id": cid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                     "finish_reason": _finish_reason(finished.result, finished.tool_calls)}],
        "usage": openai_usage(finished.result),
    })


def _completion_tokens(st: ServerState, prompt: str | list[str] | list[int]) -> list[int]:
    """Worker-thread part of /v1/completions: tokenize (or check) the prompt."""
    if isinstance(prompt, str):
        return list(st.engine.encode_prompt(prompt))
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt")
        return list(st.engine.encode_prompt(str(prompt[0])))
    tokens = [int(t) for t in prompt]
    vocab = st.engine.vocab_size
    for t in tokens:
        if t < 0 or t >= vocab:
            raise APIError(400, f"prompt token id {t} is out of range", param="prompt")
    return tokens


async def _completion_stream(gen: Generation, st: ServerState, make_chunk: Any,
                             include_usage: bool, path: str, sleep: Sleep,
                             decoder: LogprobDecoder | None) -> AsyncIterator[str]:
    pending: list[TokenEvent] = []  # logprobs travel with the next chunk
    offset = 0  # text_offset of the next token

    async def chunk(text: str, finish: str | None = None) -> str:
        nonlocal offset
        logprobs = None
        if decoder is not None:
            entries = await decoder.entries(pending)
            pending.clear()
            if entries:
                logprobs = openai_params.legacy_logprobs(entries, offset)
                offset += sum(len(e["token"]) for e in entries)
        return sse_data(make_chunk(text, finish, logprobs))

    async for ev in reply_events(gen, ReplyParser(), keepalive_s=st.config.keepalive_s,
                                 sleep=sleep):
        if ev is KEEPALIVE:
            yield SSE_COMMENT
        elif isinstance(ev, TokenEvent):
            pending.append(ev)
        elif isinstance(ev, Piece):
            yield await chunk(ev.text)
        elif isinstance(ev, Finished):
            if ev.failed:
                yield sse_data(error_body(path, 500, f"generation failed: {ev.result.error}",
                                          "engine_error"))
                break
            yield await chunk("", _finish_reason(ev.result))
            if include_usage:
                last = make_chunk("")
                last["choices"] = []
                last["usage"] = openai_usage(ev.result)
                yield sse_data(last)
            break
    yield "data: [DONE]\n\n"


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    st = state_of(request)
    model = st.check_model(body.model)
    if body.n not in (None, 1):
        raise APIError(400, "only n=1 is supported", param="n")
    openai_params.best_of(body.best_of)
    k = openai_params.completion_logprobs(body.logprobs, body.echo)
    bias = openai_params.logit_bias(body.logit_bias, st.engine.vocab_size)
    prompt = await preparer_of(request).run(_completion_tokens, st, body.prompt)
    max_tokens = plan_max_tokens(st, "openai", len(prompt), body.max_tokens)
    sampling = st.sampling(max_tokens=max_tokens, temperature=body.temperature,
                           top_p=body.top_p, seed=body.seed, stop=body.stop, logprobs=k,
                           logit_bias=bias, penalties=openai_params.penalties(body))
    decoder = (LogprobDecoder(st.engine.tokenizer, sampling.stop_token_ids)
               if k is not None else None)
    gen = st.start("openai", request, request.state.pc_scope, prompt, sampling)
    cid = f"cmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    echo = body.prompt if (body.echo and isinstance(body.prompt, str)) else ""

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def make_chunk(text: str, finish: str | None = None,
                       logprobs: Any = None) -> dict[str, Any]:
            chunk: dict[str, Any] = {
                "id": cid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                             "finish_reason": finish}],
            }
            if include_usage:
                chunk["usage"] = None
            return chunk

        return StreamingResponse(
            _completion_stream(gen, st, make_chunk, include_usage, request.url.path,
                               sleep_of(request), decoder),
            media_type="text/event-stream", headers=SSE_HEADERS)

    finished, token_events = await collect_reply(gen, ReplyParser())
    if finished.failed:
        raise _engine_failed(finished.result)
    logprobs = None
    if decoder is not None:  # no echo with logprobs: offsets start at the reply
        logprobs = openai_params.legacy_logprobs(await decoder.entries(token_events), 0)
    return JSONResponse({
        "id": cid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": echo + finished.text, "logprobs": logprobs,
                     "finish_reason": _finish_reason(finished.result)}],
        "usage": openai_usage(finished.result),
    })


def model_card(st: ServerState, model_id: str) -> dict[str, Any]:
    """One model for OpenAI and Anthropic clients: the context window and max_tokens limit."""
    window = context_window(st)
    created = int(st.started_at)
    return {
        "id": model_id, "object": "model", "created": created, "owned_by": "promptcache",
        # Anthropic's model object
        "type": "model", "display_name": model_id,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
        # the window and the output limit
        "context_window": window, "context_length": window, "max_model_len": window,
        "max_input_tokens": window, "max_output_tokens": max_output_tokens(st),
        "max_tokens": max_output_tokens(st),
    }


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    st = state_of(request)
    cards = [model_card(st, st.model_id)]
    return {"object": "list", "data": cards,
            # Anthropic's list envelope
            "has_more": False, "first_id": st.model_id, "last_id": st.model_id}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    st = state_of(request)
    st.check_model(model_id)
    return model_card(st, st.model_id)
