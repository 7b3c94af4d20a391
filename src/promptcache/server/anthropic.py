"""Anthropic-compatible endpoints: /v1/messages (streaming and not), /v1/messages/count_tokens.

Requests as Claude Code sends them are accepted: ``role: "system"`` messages anywhere
in ``messages`` (kept where they stand, see ``prompt.place_system_messages``),
``thinking`` (``enabled`` / ``adaptive`` turn the template's reasoning switch on,
``disabled`` off, where the template has one), ``tool_choice`` ``auto`` / ``any`` /
``tool`` / ``none`` (``none`` leaves the tools out; ``any`` / ``tool`` are enforced by
constrained decoding, ``structured.py``), ``cache_control`` on any block,
``context_management``, ``output_config``, ``metadata``, ``service_tier``, ``?beta=true`` and the ``anthropic-beta`` header
(accepted, ignored on purpose). Tools other than client tools (``web_search_*``,
``bash_*`` … server tools the model cannot run) are left out. Reasoning the model marks
streams back as ``thinking`` blocks.

Usage accounting (all counts are prompt tokens of this request):
- ``cache_read_input_tokens``: tokens restored from the cache;
- ``cache_creation_input_tokens``: uncached tokens this request wrote to the cache
  (its uncached prompt tokens when it saved prompt blocks, else 0);
- ``input_tokens``: uncached tokens that were not written to the cache.
The three are disjoint, as in Anthropic's API: ``input_tokens +
cache_creation_input_tokens + cache_read_input_tokens == prompt tokens`` (clients such
as Claude Code add them up to size the context).

Streaming: ``message_start`` is sent at once; its usage is a prediction from a pure
cache lookup (made off the event loop while the prompt is prepared; the engine reports
exact numbers only at the end). The exact usage is in ``message_delta``. While the
stream has nothing else to send (a long prefill) it sends ``ping`` events.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..engine.api import GenerationResult
from .common import (
    KEEPALIVE,
    SSE_HEADERS,
    ChatPrompt,
    Finished,
    Prepared,
    Sleep,
    collect_reply,
    plan_max_tokens,
    preparer_of,
    reply_events,
    reply_parser,
    sleep_of,
    sse_event,
    state_of,
)
from .errors import APIError
from .images import ImageCollector
from .prompt import anthropic_messages, anthropic_tools
from .reasoning import Piece, ReplyParser
from .runner import Generation, ServerState, cache_creation_tokens
from .schemas import CountTokensRequest, MessagesRequest
from .structured import anthropic_tool_choice
from .toolcalls import ToolCall, offered_tool_names

log = logging.getLogger(__name__)
router = APIRouter()

TOOL_CHOICES = ("auto", "any", "tool", "none")
THINKING_TYPES = {"enabled": True, "adaptive": True, "disabled": False}


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


def signature(thinking: str) -> str:
    """An opaque signature for a thinking block (clients send blocks back with it)."""
    return "promptcache-" + hashlib.sha256(thinking.encode("utf-8")).hexdigest()[:32]


def content_blocks(reasoning: str, text: str, calls: tuple[ToolCall, ...]
                   ) -> list[dict[str, Any]]:
    """[thinking?, text?, tool_use...]: the text block is left out when empty and there
    are calls or reasoning."""
    blocks: list[dict[str, Any]] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning,
                       "signature": signature(reasoning)})
    if text or not (calls or reasoning):
        blocks.append({"type": "text", "text": text})
    blocks.extend(_tool_use(c) for c in calls)
    return blocks


def _thinking_switch(thinking: dict[str, Any] | None) -> bool | None:
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in THINKING_TYPES:
        raise APIError(400, f"thinking.type: expected one of {', '.join(THINKING_TYPES)}, "
                            f"got {kind!r}", param="thinking")
    return THINKING_TYPES[kind]


def _chat_prompt(body: MessagesRequest | CountTokensRequest,
                 images: ImageCollector | None = None) -> ChatPrompt:
    msgs = anthropic_messages(body.messages, body.system, images)
    tools = anthropic_tools(body.tools)
    choice = getattr(body, "tool_choice", None)
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in TOOL_CHOICES:
            raise APIError(400, f"tool_choice.type: expected one of {', '.join(TOOL_CHOICES)}, "
                                f"got {kind!r}", param="tool_choice")
        if kind == "none":
            tools = None
    structure = anthropic_tool_choice(choice, offered_tool_names(tools)) if tools else None
    return ChatPrompt(msgs, tools, _thinking_switch(body.thinking), images=images,
                      structure=structure)


class _Blocks:
    """The content blocks of a streamed reply, opened and closed as pieces arrive."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None  # the open block: "thinking" | "text" | None
        self.thinking = ""

    def open(self, kind: str) -> list[str]:
        out = self.close()
        self.index += 1
        self.kind = kind
        block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" \
            else {"type": "text", "text": ""}
        self.thinking = ""
        out.append(sse_event("content_block_start", {
            "type": "content_block_start", "index": self.index, "content_block": block}))
        return out

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        out = []
        if self.kind == "thinking":
            out.append(self._delta({"type": "signature_delta",
                                    "signature": signature(self.thinking)}))
        out.append(sse_event("content_block_stop", {"type": "content_block_stop",
                                                    "index": self.index}))
        self.kind = None
        return out

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse_event("content_block_delta", {"type": "content_block_delta",
                                                 "index": self.index, "delta": delta})

    def piece(self, p: Piece) -> list[str]:
        kind = "thinking" if p.kind == "reasoning" else "text"
        out = self.open(kind) if self.kind != kind else []
        if kind == "thinking":
            self.thinking += p.text
            out.append(self._delta({"type": "thinking_delta", "thinking": p.text}))
        else:
            out.append(self._delta({"type": "text_delta", "text": p.text}))
        return out

    def tool_use(self, call: ToolCall) -> list[str]:
        out = self.close()
        self.index += 1
        block = _tool_use(call)
        block["input"] = {}
        return out + [
            sse_event("content_block_start", {"type": "content_block_start",
                                              "index": self.index, "content_block": block}),
            self._delta({"type": "input_json_delta", "partial_json": call.arguments_json}),
            sse_event("content_block_stop", {"type": "content_block_stop",
                                             "index": self.index}),
        ]


async def _stream(gen: Generation, st: ServerState, parser: ReplyParser, msg_id: str,
                  model: str, prepared: Prepared, caching: bool, sleep: Sleep
                  ) -> AsyncIterator[str]:
    """The event sequence. A plain reply (no tools offered, no reasoning markers) opens
    its text block at once; otherwise blocks open as their first piece arrives, and
    tool_use blocks follow at the end."""
    prompt_len, predicted = len(prepared.tokens), prepared.predicted_cached
    created = (prompt_len - predicted) if caching else 0
    start_usage = {"input_tokens": prompt_len - predicted - created,
                   "cache_creation_input_tokens": created,
                   "cache_read_input_tokens": predicted, "output_tokens": 0}
    yield sse_event("message_start", {"type": "message_start", "message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": start_usage}})
    blocks = _Blocks()
    plain = not prepared.tool_names and not prepared.chat_format.has_thinking
    if plain:
        for event in blocks.open("text"):
            yield event
    yield sse_event("ping", {"type": "ping"})
    async for ev in reply_events(gen, parser, keepalive_s=st.config.keepalive_s, sleep=sleep):
        if ev is KEEPALIVE:
            yield sse_event("ping", {"type": "ping"})
        elif isinstance(ev, Piece):
            for event in blocks.piece(ev):
                yield event
        elif isinstance(ev, Finished):
            if ev.failed:
                yield sse_event("error", {"type": "error", "error": {
                    "type": "api_error", "message": f"generation failed: {ev.result.error}"}})
                return
            if blocks.index < 0 and not ev.tool_calls:
                for event in blocks.open("text"):
                    yield event
            for event in blocks.close():
                yield event
            for call in ev.tool_calls:
                for event in blocks.tool_use(call):
                    yield event
            yield sse_event("message_delta", {"type": "message_delta",
                                              "delta": _stop(ev.result, ev.tool_calls),
                                              "usage": anthropic_usage(ev.result)})
            yield sse_event("message_stop", {"type": "message_stop"})
            return


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request) -> Any:
    st = state_of(request)
    model = st.check_model(body.model)
    if body.temperature is not None and not 0.0 <= body.temperature <= 1.0:
        raise APIError(400, f"temperature must be in [0, 1], got {body.temperature}",
                       param="temperature")
    scope = request.state.pc_scope
    chat = _chat_prompt(body, st.image_collector())
    prepared = await preparer_of(request).prepare(
        chat, predict_tenant=scope.tenant if body.stream else None)
    max_tokens = plan_max_tokens(st, "anthropic", len(prepared.tokens), body.max_tokens)
    sampling = st.sampling(max_tokens=max_tokens, temperature=body.temperature,
                           top_p=body.top_p, seed=None, stop=body.stop_sequences,
                           top_k=body.top_k)
    gen = st.start("anthropic", request, scope, prepared.tokens, sampling,
                   prepared.message_starts, images=prepared.images,
                   constraint=prepared.constraint)
    parser = reply_parser(prepared)
    msg_id = f"msg_{uuid.uuid4().hex[:24]}"
    if body.stream:
        caching = getattr(st.engine, "cache", None) is not None
        return StreamingResponse(_stream(gen, st, parser, msg_id, model, prepared, caching,
                                         sleep_of(request)),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    finished, _ = await collect_reply(gen, parser)
    if finished.failed:
        raise APIError(500, f"generation failed: {finished.result.error or 'engine error'}")
    return JSONResponse({
        "id": msg_id, "type": "message", "role": "assistant", "model": model,
        "content": content_blocks(finished.reasoning, finished.text, finished.tool_calls),
        **_stop(finished.result, finished.tool_calls),
        "usage": anthropic_usage(finished.result),
    })


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    st = state_of(request)
    st.check_model(body.model)
    n = await preparer_of(request).count(_chat_prompt(body, st.image_collector()))
    return {"input_tokens": n}
