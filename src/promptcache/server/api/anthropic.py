"""Anthropic-compatible /v1/messages and /v1/messages/count_tokens (docs/api.md). Usage is
disjoint as in Anthropic's API; ``message_start`` carries a prediction from a pure cache
lookup, ``message_delta`` the exact usage."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..ops.diagnostics import cache_cause_of, wants_diagnostics
from ..prompts.canon import Canon
from ..prompts.images import ImageCollector
from ..prompts.prepared import Breakpoint, ChatPrompt, Prepared, TurnContext
from ..prompts.preparer import preparer_of
from ..prompts.prompt import anthropic_messages, anthropic_tools
from ..prompts.structured import anthropic_tool_choice
from ..prompts.turns import after_reply, caching, plan_max_tokens, start
from ..replies.reasoning import Piece, ReplyParser
from ..replies.reply import (
    KEEPALIVE,
    SSE_HEADERS,
    Finished,
    Sleep,
    collect_reply,
    reply_events,
    reply_parser,
    sleep_of,
    sse_event,
)
from ..replies.runner import Generation, ServerState, state_of
from ..replies.toolcalls import ToolCall, offered_tool_names
from .anthropic_body import (
    TTLS,
    anthropic_usage,
    content_blocks,
    creation,
    signature,
    stop_fields,
    tool_use_block,
)
from .errors import APIError
from .schemas import AnthropicMessage, CountTokensRequest, MessagesRequest

log = logging.getLogger(__name__)
router = APIRouter()

TOOL_CHOICES = ("auto", "any", "tool", "none")
THINKING_TYPES = {"enabled": True, "adaptive": True, "disabled": False}


def _thinking_switch(thinking: dict[str, Any] | None) -> bool | None:
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in THINKING_TYPES:
        raise APIError(400, f"thinking.type: expected one of {', '.join(THINKING_TYPES)}, "
                            f"got {kind!r}", param="thinking")
    return THINKING_TYPES[kind]


def _ttl(cache_control: Any, where: str) -> float | None:
    if cache_control is None:
        return None
    if not isinstance(cache_control, dict) or cache_control.get("type") != "ephemeral":
        raise APIError(400, f"{where}.cache_control: expected {{'type': 'ephemeral'}}",
                       param=f"{where}.cache_control")
    ttl = cache_control.get("ttl", "5m")
    if ttl not in TTLS:
        raise APIError(400, f"{where}.cache_control.ttl: expected '5m' or '1h', got {ttl!r}",
                       param=f"{where}.cache_control.ttl")
    return TTLS[ttl]


def breakpoints_of(body: MessagesRequest | CountTokensRequest, msgs: list[dict[str, Any]],
                   images: ImageCollector | None = None) -> tuple[Breakpoint, ...]:
    """The request's ``cache_control`` breakpoints on the template messages ``msgs``
    (system blocks and tools: the end of the system prompt; top-level: the last message)."""
    out: list[Breakpoint] = []
    for i, block in enumerate(body.system if isinstance(body.system, list) else ()):
        ttl = _ttl(block.get("cache_control"), f"system[{i}]")
        if ttl is not None:
            out.append(Breakpoint(None, ttl))
    for i, tool in enumerate(body.tools or ()):
        ttl = _ttl((tool.model_extra or {}).get("cache_control"), f"tools[{i}]")
        if ttl is not None:
            out.append(Breakpoint(None, ttl))
    top = _ttl((body.model_extra or {}).get("cache_control"), "body")
    if top is not None:
        out.append(Breakpoint(len(msgs) - 1, top))
    lead = 1 if msgs and body.system and msgs[0]["role"] == "system" else 0
    count = lead
    last = len(body.messages) - 1
    for i, m in enumerate(body.messages):
        ttls = [_ttl(b.get("cache_control"), f"messages[{i}].content[{j}]")
                for j, b in enumerate(m.content if isinstance(m.content, list) else ())]
        marks = [t for t in ttls if t is not None]
        if i == last:
            count = len(msgs)
        elif marks:  # how many template messages messages[0..i] made (tool results split)
            count = lead + len(anthropic_messages(body.messages[:i + 1], None,
                                                  _counting(images)))
        if marks:
            out.append(Breakpoint(max(0, count - 1), max(marks)))
    return tuple(out)


def _counting(images: ImageCollector | None) -> ImageCollector | None:
    """An empty collector like ``images``: the messages' images counted again, not kept."""
    return None if images is None else ImageCollector(images.info, images.limits)


def chat_prompt(body: MessagesRequest | CountTokensRequest, canon: Canon,
                images: ImageCollector | None = None) -> ChatPrompt:
    """The request as a ``ChatPrompt`` (also what ``/v1/cache/probe`` renders)."""
    system = canon.system_blocks(body.system) if isinstance(body.system, list) \
        else body.system
    msgs = anthropic_messages(body.messages, system, images)
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
                      structure=structure, source=body,
                      breakpoints=breakpoints_of(body, msgs, images))


def _diagnostics_field(body: MessagesRequest) -> tuple[str | None, bool]:
    """``diagnostics.previous_message_id`` and whether the request named one (null too)."""
    diag = body.diagnostics
    if diag is None:
        return None, False
    prev = diag.get("previous_message_id")
    if prev is not None and not isinstance(prev, str):
        raise APIError(400, "diagnostics.previous_message_id must be a string or null",
                       param="diagnostics.previous_message_id")
    return prev, "previous_message_id" in diag


class _Blocks:
    """The content blocks of a streamed reply, opened and closed as pieces arrive."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None  # the open block: "thinking" | "text" | None
        self.thinking = ""
        self.uses: list[dict[str, Any]] = []  # the tool_use blocks sent (ids and input)

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
        block = tool_use_block(call)
        self.uses.append(dict(block))
        block["input"] = {}
        return out + [
            sse_event("content_block_start", {"type": "content_block_start",
                                              "index": self.index, "content_block": block}),
            self._delta({"type": "input_json_delta", "partial_json": call.arguments_json}),
            sse_event("content_block_stop", {"type": "content_block_stop",
                                             "index": self.index}),
        ]


def echo_messages(text: str, uses: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A reply as the next request carries it (thinking not replayed), read by this parser."""
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}, *uses]
    return anthropic_messages([AnthropicMessage(role="assistant", content=blocks)], None)


async def _stream(gen: Generation, st: ServerState, parser: ReplyParser, msg_id: str,
                  model: str, prepared: Prepared, cache_on: bool, sleep: Sleep,
                  diagnose: bool, on_reply: Callable[[list[dict[str, Any]]], None]
                  ) -> AsyncIterator[str]:
    """The event sequence: a plain reply opens its text block at once, else blocks open
    as their first piece arrives, tool_use blocks last; ``diagnostics`` rides on
    ``message_start`` (the same lookup as its usage)."""
    prompt_len, predicted = len(prepared.tokens), prepared.predicted_cached
    # a prompt the cache holds whole stores no blocks: no cache creation
    writes = cache_on and not prepared.predicted_whole
    created, split = creation(prompt_len, predicted, prepared.breakpoints) if writes \
        else (0, {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0})
    start_usage = {"input_tokens": prompt_len - predicted - created,
                   "cache_creation_input_tokens": created,
                   "cache_read_input_tokens": predicted, "cache_creation": split,
                   "output_tokens": 0}
    message: dict[str, Any] = {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": start_usage}
    if diagnose:
        found = prepared.divergence.diagnose(predicted, prepared.predicted_cause, cache_on)
        message["diagnostics"] = found.to_wire() if found else None
    yield sse_event("message_start", {"type": "message_start", "message": message})
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
            on_reply(echo_messages(ev.text, blocks.uses))
            yield sse_event("message_delta", {"type": "message_delta",
                                              "delta": stop_fields(ev.result, ev.tool_calls),
                                              "usage": anthropic_usage(ev.result,
                                                                       prepared.breakpoints)})
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
    preparer = preparer_of(request)
    chat = chat_prompt(body, preparer.canon, st.image_collector())
    previous, named = _diagnostics_field(body)
    diagnose = wants_diagnostics(request.headers.get("anthropic-beta"), body.diagnostics)
    turn = TurnContext.of(scope, previous, named)
    prepared = await preparer.prepare(
        chat, predict_tenant=scope.tenant if body.stream else None, turn=turn, generate=True)
    max_tokens = plan_max_tokens(st, "anthropic", len(prepared.tokens), body.max_tokens)
    sampling = st.sampling(max_tokens=max_tokens, temperature=body.temperature,
                           top_p=body.top_p, seed=None, stop=body.stop_sequences,
                           top_k=body.top_k)
    msg_id = f"msg_{uuid.uuid4().hex[:24]}"
    gen = start(st, "anthropic", request, scope, prepared, sampling, turn, message_id=msg_id)
    parser = reply_parser(prepared)
    cache_on = caching(st)

    def on_reply(reply: list[dict[str, Any]]) -> None:
        after_reply(request, gen, turn, prepared, chat, reply)

    if body.stream:
        return StreamingResponse(_stream(gen, st, parser, msg_id, model, prepared, cache_on,
                                         sleep_of(request), diagnose, on_reply),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    finished, _ = await collect_reply(gen, parser)
    if finished.failed:
        raise APIError(500, f"generation failed: {finished.result.error or 'engine error'}")
    content = content_blocks(finished.reasoning, finished.text, finished.tool_calls)
    on_reply(echo_messages(finished.text, [b for b in content if b["type"] == "tool_use"]))
    out: dict[str, Any] = {
        "id": msg_id, "type": "message", "role": "assistant", "model": model,
        "content": content,
        **stop_fields(finished.result, finished.tool_calls),
        "usage": anthropic_usage(finished.result, prepared.breakpoints),
    }
    if diagnose:
        result = finished.result
        found = prepared.divergence.diagnose(result.usage.cached_tokens,
                                             cache_cause_of(result.miss), cache_on)
        out["diagnostics"] = found.to_wire() if found else None
    return JSONResponse(out)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    st = state_of(request)
    st.check_model(body.model)
    preparer = preparer_of(request)
    n = await preparer.count(chat_prompt(body, preparer.canon, st.image_collector()))
    return {"input_tokens": n}
