"""A reply on its way out: ``reply_parser``, the pump (``reply_events`` /
``collect_reply``), ``LogprobDecoder`` and SSE framing with keep-alive ticks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

from ...engine.api import GenerationResult, TokenEvent
from ...engine.port import TokenizerAPI
from ..prompts.prepared import Prepared
from .harmony import HarmonyParser
from .reasoning import Piece, ReplyParser
from .runner import Generation, unstreamed_tail
from .toolcalls import ToolCall

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_COMMENT = ": keep-alive\n\n"

Sleep = Callable[[float], Awaitable[Any]]


def sleep_of(request: Request) -> Sleep:
    """The keep-alive timer of the app (``asyncio.sleep``; tests set a fake clock)."""
    sleep: Sleep = getattr(request.app.state, "pc_sleep", asyncio.sleep)
    return sleep


def sse_data(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def sse_event(name: str, data: Any) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class _KeepAlive:
    def __repr__(self) -> str:
        return "KEEPALIVE"


KEEPALIVE = _KeepAlive()


async def with_keepalive(events: AsyncIterator[T], interval: float,
                         sleep: Sleep = asyncio.sleep) -> AsyncIterator[T | _KeepAlive]:
    """``events`` with ``KEEPALIVE`` after ``interval`` silent seconds (``sleep``: the timer)."""
    source = events.__aiter__()
    nxt: asyncio.Task[T] | None = None
    try:
        while True:
            if nxt is None:
                nxt = asyncio.ensure_future(source.__anext__())
            timer = asyncio.ensure_future(sleep(interval))
            try:
                done, _ = await asyncio.wait({nxt, timer}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not timer.done():
                    timer.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await timer
            if nxt in done:
                try:
                    item = nxt.result()
                except StopAsyncIteration:
                    return
                nxt = None
                yield item
            else:
                yield KEEPALIVE
    finally:
        if nxt is not None and not nxt.done():
            nxt.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await nxt
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()


def reply_parser(prepared: Prepared) -> ReplyParser:
    cf = prepared.chat_format
    if cf.harmony:
        return HarmonyParser(tool_names=prepared.tool_names, tools=prepared.tools)
    return ReplyParser(cf.think_start, cf.think_end, in_reasoning=prepared.in_reasoning,
                       tool_names=prepared.tool_names,
                       tool_format=prepared.tool_format or cf.tools_format(False),
                       tools=prepared.tools, calls_only=prepared.forced_call)


@dataclass(frozen=True)
class Finished:
    """The end of a reply: the engine's result, tool calls, reasoning and text as streamed."""

    result: GenerationResult
    tool_calls: tuple[ToolCall, ...]
    reasoning: str
    text: str
    # tokens generated while the reply was inside its reasoning
    reasoning_tokens: int = 0

    @property
    def failed(self) -> bool:
        return self.result.finish_reason == "error"


ReplyEvent = Piece | TokenEvent | Finished | _KeepAlive


async def reply_events(gen: Generation, parser: ReplyParser, *,
                       keepalive_s: float | None = None, sleep: Sleep = asyncio.sleep
                       ) -> AsyncIterator[ReplyEvent]:
    """One reply: ``Piece``s, ``TokenEvent``s with logprobs, ``KEEPALIVE`` ticks, ``Finished``."""
    streamed: list[str] = []
    thinking = 0
    events: AsyncIterator[Any] = gen.events()
    if keepalive_s is not None:
        events = with_keepalive(events, keepalive_s, sleep)
    async for ev in events:
        if ev is KEEPALIVE:
            yield KEEPALIVE
            continue
        if isinstance(ev, GenerationResult):
            if ev.finish_reason == "error":
                yield Finished(ev, (), parser.reasoning, parser.text, thinking)
                return
            tail = unstreamed_tail("".join(streamed), ev)
            for piece in parser.feed(tail) if tail else []:
                yield piece
            rest, calls = parser.finish()
            for piece in rest:
                yield piece
            yield Finished(ev, calls, parser.reasoning, parser.text, thinking)
            return
        if ev.logprob is not None:
            yield ev
        if parser.in_reasoning:
            thinking += 1
        if ev.text:
            streamed.append(ev.text)
            for piece in parser.feed(ev.text):
                yield piece


async def collect_reply(gen: Generation, parser: ReplyParser
                        ) -> tuple[Finished, list[TokenEvent]]:
    """A non-streamed reply: its ``Finished`` and the ``TokenEvent``s with logprobs."""
    tokens: list[TokenEvent] = []
    async for ev in reply_events(gen, parser):
        if isinstance(ev, TokenEvent):
            tokens.append(ev)
        elif isinstance(ev, Finished):
            return ev, tokens
    raise RuntimeError("engine stream ended without a result")  # the engine always ends with one


class LogprobDecoder:
    """OpenAI logprob entries from ``TokenEvent``s, tokens decoded in a worker thread
    (memoised); the token that ended the reply has no entry, as in OpenAI's API."""

    def __init__(self, tokenizer: TokenizerAPI, stop_token_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self._memo: dict[int, str] = {}
        eos = getattr(tokenizer, "eos_token_ids", None) or ()
        self._stop = frozenset(int(t) for t in eos) | frozenset(stop_token_ids)

    def _decode(self, ids: list[int]) -> None:
        for t in ids:
            if t not in self._memo:
                self._memo[t] = str(self.tokenizer.decode([t]))

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._memo[token_id]
        return {"token": text, "logprob": float(logprob),
                "bytes": list(text.encode("utf-8"))}

    async def entries(self, events: list[TokenEvent]) -> list[dict[str, Any]]:
        events = [ev for ev in events if ev.token_id not in self._stop]
        ids = [ev.token_id for ev in events] + [t for ev in events for t, _ in ev.top_logprobs]
        missing = [t for t in dict.fromkeys(ids) if t not in self._memo]
        if missing:
            await asyncio.to_thread(self._decode, missing)
        out = []
        for ev in events:
            lp = ev.logprob if ev.logprob is not None else 0.0
            # JSON has no -inf: masked-out alternatives are left out (OpenAI: -9999.0)
            entry = self._entry(ev.token_id, lp if math.isfinite(lp) else -9999.0)
            entry["top_logprobs"] = [self._entry(t, alt) for t, alt in ev.top_logprobs
                                     if math.isfinite(alt)]
            out.append(entry)
        return out
