"""OpenAI Responses API: POST /v1/responses, GET / DELETE /v1/responses/{id} (docs/api.md):
``previous_response_id`` continues a stored response, ``prompt_cache_key`` names the session
when no header does; output [reasoning?, message?, function_call...], usage at the end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ...engine.api import TokenEvent
from ..prompts.images import ImageCollector
from ..prompts.prepared import ChatPrompt, TurnContext
from ..prompts.preparer import preparer_of
from ..prompts.structured import openai_tool_choice, responses_text_format
from ..prompts.turns import after_reply, plan_max_tokens, retention_of, start
from ..replies.reasoning import Piece, ReplyParser
from ..replies.reply import (
    KEEPALIVE,
    SSE_COMMENT,
    SSE_HEADERS,
    Finished,
    LogprobDecoder,
    Sleep,
    reply_events,
    reply_parser,
    sleep_of,
)
from ..replies.runner import Generation, ServerState, state_of
from ..replies.toolcalls import offered_tool_names
from . import openai_params
from .errors import APIError
from .responses_events import ReplyItems, new_id, responses_usage
from .responses_items import (
    Conversation,
    OfferedTools,
    ResponseStore,
    StoredResponse,
    TenantResponses,
    responses_tools,
)
from .schemas import ResponsesRequest

router = APIRouter()


def store_of(request: Request) -> TenantResponses:
    """The stored responses of the request's tenant (no other tenant's are reachable)."""
    store: ResponseStore = request.app.state.pc_responses
    return store.scoped(request.state.pc_scope.tenant)


def _not_found(rid: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id '{rid}' not found.", code="not_found",
                    param=param)


def _thinking_switch(reasoning: dict[str, Any] | None) -> bool | None:
    effort = (reasoning or {}).get("effort")
    if effort is None:
        return None
    return effort not in ("none", "minimal")


def _response(rid: str, body: ResponsesRequest, model: str, created: int, *,
              status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
              store: bool, incomplete: str | None = None,
              error: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "background": False, "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "model": model, "output": output,
        "parallel_tool_calls": True if body.parallel_tool_calls is None
        else body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "prompt_cache_key": body.prompt_cache_key,
        "reasoning": {"effort": (body.reasoning or {}).get("effort"),
                      "summary": (body.reasoning or {}).get("summary")},
        "store": store, "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": body.text or {"format": {"type": "text"}},
        "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
        "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
        "usage": usage, "user": body.user, "metadata": body.metadata or {},
    }


class _Call:
    def __init__(self, st: ServerState, body: ResponsesRequest, model: str,
                 conv: Conversation, offered: OfferedTools, store: TenantResponses,
                 decoder: LogprobDecoder | None) -> None:
        self.st, self.body, self.model = st, body, model
        self.conv, self.offered, self.store, self.decoder = conv, offered, store, decoder
        self.rid = new_id("resp")
        self.created = int(time.time())
        self.keep = body.store is not False
        self.response: dict[str, Any] | None = None
        self.failure: str | None = None
        # called with the reply as the next request will carry it (pre-render)
        self.on_reply: Callable[[list[dict[str, Any]]], None] | None = None

    def base(self, status: str, output: list[dict[str, Any]],
             usage: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
        return _response(self.rid, self.body, self.model, self.created, status=status,
                         output=output, usage=usage, store=self.keep, **kw)

    def final(self, fin: Finished, output: list[dict[str, Any]]) -> dict[str, Any]:
        incomplete = "max_output_tokens" if fin.result.finish_reason == "length" else None
        response = self.base("incomplete" if incomplete else "completed", output,
                             responses_usage(fin.result, fin.reasoning_tokens),
                             incomplete=incomplete)
        conv = self.conv.copy()
        conv.add_output(output)
        if self.keep:
            self.store.put(self.rid, StoredResponse(response, conv))
        if self.on_reply is not None:
            # sent back or named, the conversation grows by exactly these messages
            self.on_reply(conv.messages[len(self.conv.messages):])
        return response


async def _events(call: _Call, gen: Generation, reply: ReplyItems, parser: ReplyParser,
                  sleep: Sleep | None = None) -> AsyncIterator[str]:
    """The stream; a non-streamed request runs it too and keeps ``call.response``."""
    yield reply.event("response.created", response=call.base("in_progress", []))
    yield reply.event("response.in_progress", response=call.base("in_progress", []))
    interval = call.st.config.keepalive_s if sleep is not None else None
    async for ev in reply_events(gen, parser, keepalive_s=interval,
                                 sleep=sleep or asyncio.sleep):
        if ev is KEEPALIVE:
            yield SSE_COMMENT
        elif isinstance(ev, TokenEvent):
            reply.pending.append(ev)
        elif isinstance(ev, Piece):
            for event in await reply.piece(ev):
                yield event
        elif isinstance(ev, Finished):
            if ev.failed:
                error = {"code": "server_error",
                         "message": f"generation failed: {ev.result.error}"}
                call.failure = error["message"]
                yield reply.event("response.failed",
                                  response=call.base("failed", reply.output, error=error))
                return
            for event in await reply.finish(ev):
                yield event
            response = call.final(ev, reply.output)
            call.response = response
            done = "response.incomplete" if response["status"] == "incomplete" \
                else "response.completed"
            yield reply.event(done, response=response)
            return


def chat_prompt(body: ResponsesRequest, store: TenantResponses,
                images: ImageCollector | None = None
                ) -> tuple[Conversation, OfferedTools, ChatPrompt]:
    """The conversation, the tools and the ``ChatPrompt`` (also for ``/v1/cache/probe``)."""
    json_output = responses_text_format(body.text)
    if body.input is None and body.previous_response_id is None:
        raise APIError(400, "input is required", param="input")
    conv = Conversation()
    if body.previous_response_id is not None:
        prev = store.get(body.previous_response_id)
        if prev is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        conv = prev.conversation.copy()
    if conv.images is None:
        conv.images = images
    conv.add_input(body.input, store)
    offered = responses_tools(body.tools)
    tools = offered.tools if body.tool_choice != "none" else None
    structure = openai_tool_choice(body.tool_choice, offered_tool_names(tools),
                                   body.parallel_tool_calls, responses=True) or json_output
    messages = conv.messages
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}] + messages
    return conv, offered, ChatPrompt(messages, tools, _thinking_switch(body.reasoning),
                                     images=conv.images, structure=structure,
                                     source=body, retention=retention_of(body))


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Any:
    st = state_of(request)
    model = st.check_model(body.model)
    store = store_of(request)
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
        raise APIError(400, f"top_logprobs must be in [0, 20], got {body.top_logprobs}",
                       param="top_logprobs")
    conv, offered, chat = chat_prompt(body, store, st.image_collector())
    scope = request.state.pc_scope.with_session(body.prompt_cache_key, "prompt_cache_key")
    turn = TurnContext.of(scope)
    prepared = await preparer_of(request).prepare(chat, turn=turn, generate=True)
    max_tokens = plan_max_tokens(st, "openai", len(prepared.tokens), body.max_output_tokens,
                                 "max_output_tokens")
    k = body.top_logprobs
    sampling = st.sampling(max_tokens=max_tokens, temperature=body.temperature,
                           top_p=body.top_p, seed=None, stop=None, logprobs=k,
                           penalties=openai_params.penalties(body))
    gen = start(st, "responses", request, scope, prepared, sampling, turn)
    decoder = (LogprobDecoder(st.engine.tokenizer, sampling.stop_token_ids)
               if k is not None else None)
    call = _Call(st, body, model, conv, offered, store, decoder)

    def on_reply(reply: list[dict[str, Any]]) -> None:
        after_reply(request, gen, turn, prepared, chat, reply)

    call.on_reply = on_reply
    reply = ReplyItems(offered, decoder)
    parser = reply_parser(prepared)
    if body.stream:
        return StreamingResponse(_events(call, gen, reply, parser, sleep_of(request)),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    async for _ in _events(call, gen, reply, parser):
        pass
    if call.response is None:
        raise APIError(500, call.failure or "generation failed", code="engine_error")
    return JSONResponse(call.response)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    stored = store_of(request).get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored.response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    if not store_of(request).delete(response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
