"""What every API module (openai.py, responses.py, anthropic.py) shares.

- ``state_of(request)``: the app's ``ServerState`` and ``preparer_of(request)``: its
  ``Preparer``.
- **Preparation off the event loop.** ``Preparer.prepare(chat)`` is the one place where
  a parsed request (``ChatPrompt``: template messages, tools, thinking switch) becomes a
  prompt: system-message placement and the tools fallback (``prompt.py``), the chat
  template, tokenization, message offsets, whether the prompt ends inside a reasoning
  block, and (for a streamed usage prediction) a cache lookup. All of it runs in one
  worker thread per app (one thread: the fast tokenizer is not safe to share between
  threads); the event loop only awaits it. The template's abilities (a system turn
  mid-conversation, rendering ``tools``) are probed once per app, in that thread.
- **The context-window policy** (``plan_max_tokens``), in the wordings clients parse.
- **SSE**: ``sse_data`` / ``sse_event`` and ``with_keepalive``, which interleaves
  ``KEEPALIVE`` ticks into an event stream that has been silent for ``interval``
  seconds (the APIs send an Anthropic ``ping`` or an SSE comment).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from ..engine.api import (
    Constraint,
    GenerationResult,
    ImageInput,
    TokenEvent,
    expand_placeholders,
    image_extra_keys,
)
from ..engine.chat_format import ChatFormat, ToolCallFormat
from .errors import APIError
from .images import ImageCollector
from .prompt import place_system_messages, tools_into_system
from .reasoning import Piece, ReplyParser
from .runner import Generation, ServerState, unstreamed_tail
from .structured import OutputSpec, PromptShape, check_constraint, constraint_for, thinking_for
from .toolcalls import ToolCall, offered_tool_names

log = logging.getLogger(__name__)

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_COMMENT = ": keep-alive\n\n"


def state_of(request: Request) -> ServerState:
    st: ServerState = request.app.state.pc
    return st


def preparer_of(request: Request) -> Preparer:
    prep: Preparer = request.app.state.pc_prepare
    return prep


Sleep = Callable[[float], Awaitable[Any]]


def sleep_of(request: Request) -> Sleep:
    """The keep-alive timer of the app (``asyncio.sleep``; tests set a fake clock)."""
    sleep: Sleep = getattr(request.app.state, "pc_sleep", asyncio.sleep)
    return sleep


# --- SSE --------------------------------------------------------------------------------


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
    """``events``, with ``KEEPALIVE`` after every ``interval`` seconds without one.

    ``sleep`` is the timer (a test passes a controllable clock). The source iterator is
    advanced by one task at a time and closed when this generator is."""
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


# --- preparation ------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatPrompt:
    """A parsed chat request, before the template: what every API turns its body into."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    # the request's reasoning switch (Anthropic ``thinking``, Responses ``reasoning``):
    # None = the template's default
    thinking: bool | None = None
    # the images of a vision-language prompt (decoded in the worker thread), else None
    images: ImageCollector | None = None
    # what the reply must be (structured.py: a JSON schema, a forced tool call)
    structure: OutputSpec | None = None


@dataclass(frozen=True)
class Prepared:
    tokens: list[int]
    message_starts: list[int]
    tool_names: frozenset[str]
    # the tools went into the system turn (the template drops ``tools``)
    tools_in_system: bool
    # the final assistant message is continued (a prefill), not answered
    continues: bool
    # the prompt ends inside a reasoning block: the reply starts with reasoning
    in_reasoning: bool
    # cache lookup for a streamed usage prediction (0 when not asked or no cache)
    predicted_cached: int
    chat_format: ChatFormat
    # decoded images with their placeholder spans (``tokens`` holds the placeholders)
    images: tuple[ImageInput, ...] = field(default=())
    # the tool-call format the model was asked for (its own, or the Hermes fallback)
    tool_format: ToolCallFormat | None = None
    tools: list[dict[str, Any]] | None = None
    # constrained decoding for the request's ``structure`` (compiled, checked)
    constraint: Constraint | None = None


@dataclass(frozen=True)
class TemplateAbilities:
    mid_system: bool  # renders a system turn after other turns
    tools: bool  # renders the ``tools`` it is given


_PROBE_TOOL = {"type": "function", "function": {
    "name": "promptcache_probe", "description": "probe",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
_PROBE_TEXT = "promptcache-probe-7d1f"


def _chat_format(engine: Any) -> ChatFormat:
    cf = getattr(engine, "chat_format", None)
    return cf if isinstance(cf, ChatFormat) else ChatFormat()


class Preparer:
    """Renders prompts for one app in one worker thread (see the module docstring)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._abilities: TemplateAbilities | None = None
        self.chat_format = _chat_format(engine)

    def close(self) -> None:
        """Stop the worker (at app shutdown; a later request starts a new one)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1,
                                                thread_name_prefix="promptcache-prep")
            return self._pool

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` in the worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor(), fn, *args)

    async def prepare(self, chat: ChatPrompt, *, predict_tenant: str | None = None
                      ) -> Prepared:
        return await self.run(self._prepare, chat, predict_tenant)

    async def count(self, chat: ChatPrompt) -> int:
        prepared = await self.prepare(chat)
        return len(prepared.tokens)

    # ---- the worker thread

    def _render(self, messages: list[dict[str, Any]], tools: Any, *, cont: bool = False,
                kwargs: dict[str, Any] | None = None, offsets: bool = False
                ) -> tuple[list[int], list[int]]:
        engine = self.engine
        opts: dict[str, Any] = {}
        if cont:
            opts["continue_final_message"] = True
        if kwargs:
            opts["template_kwargs"] = kwargs
        if offsets and hasattr(engine, "render_chat_with_offsets"):
            tokens, starts = engine.render_chat_with_offsets(messages, tools=tools, **opts)
            return list(tokens), list(starts)
        return list(engine.render_chat(messages, tools=tools, **opts)), []

    def abilities(self) -> TemplateAbilities:
        """Probe the template once (worker thread only)."""
        if self._abilities is None:
            user = [{"role": "user", "content": "hi"}]
            try:
                tools_ok = self._render(user, [_PROBE_TOOL])[0] != self._render(user, None)[0]
            except Exception:  # a template that fails on tools cannot render them
                tools_ok = False
            try:
                probe = [{"role": "user", "content": "a"},
                         {"role": "system", "content": _PROBE_TEXT},
                         {"role": "user", "content": "b"}]
                text = str(self.engine.tokenizer.decode(self._render(probe, None)[0]))
                mid_ok = _PROBE_TEXT in text
            except Exception:  # "system message must be first" and similar
                mid_ok = False
            self._abilities = TemplateAbilities(mid_system=mid_ok, tools=tools_ok)
            log.info("chat template: system turn mid-conversation %s, tools %s",
                     "rendered" if mid_ok else "as a note in the user turn",
                     "rendered" if tools_ok else "dropped (fallback: in the system turn)")
        return self._abilities

    def _prepare(self, chat: ChatPrompt, predict_tenant: str | None) -> Prepared:
        if not chat.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        ab = self.abilities()
        messages = place_system_messages(chat.messages, ab.mid_system)
        tools = chat.tools or None
        names = offered_tool_names(tools)
        in_system = False
        if tools and not ab.tools:
            messages, tools, in_system = tools_into_system(messages, tools), None, True
        cont = messages[-1]["role"] == "assistant"
        kwargs = self.chat_format.thinking_kwargs(thinking_for(chat.structure, chat.thinking))
        try:
            tokens, starts = self._render(messages, tools, cont=cont, kwargs=kwargs,
                                          offsets=True)
        except (ValueError, APIError):
            raise
        except Exception as e:  # jinja TemplateError & co: caused by the request's messages
            raise APIError(400, f"cannot render the chat template for these messages: {e}",
                           code="invalid_messages", param="messages") from e
        images: tuple[ImageInput, ...] = ()
        if chat.images is not None and chat.images.sources:
            decoded = chat.images.decode()  # APIError 400 for a bad image
            try:
                tokens, new_starts, images = expand_placeholders(
                    tokens, starts, chat.images.info, decoded)
            except ValueError as e:
                raise APIError(400, str(e), code="invalid_image", param="messages") from None
            starts = list(new_starts)
        in_reasoning = self._ends_in_reasoning(tokens)
        fmt = self.chat_format.tools_format(ab.tools)
        constraint = None
        if chat.structure is not None:
            prefill = messages[-1].get("content") if cont else None
            constraint = constraint_for(chat.structure, PromptShape(
                self.chat_format, fmt, chat.tools, in_reasoning=in_reasoning,
                may_reason=chat.thinking is True,
                prefill=prefill if isinstance(prefill, str) else None))
            if constraint is not None:
                check_constraint(constraint, self.engine, chat.structure.param)
        return Prepared(tokens=tokens, message_starts=starts, tool_names=names,
                        tools_in_system=in_system, continues=cont,
                        in_reasoning=in_reasoning,
                        predicted_cached=self._predict(tokens, predict_tenant, images),
                        chat_format=self.chat_format, images=images, tool_format=fmt,
                        tools=chat.tools or None, constraint=constraint)

    def _ends_in_reasoning(self, tokens: list[int]) -> bool:
        cf = self.chat_format
        if not cf.has_thinking or not tokens:
            return False
        try:
            tail = str(self.engine.tokenizer.decode(tokens[-64:]))
        except Exception:
            return False
        return tail.rfind(cf.think_start or "") > tail.rfind(cf.think_end or "")

    def _predict(self, tokens: list[int], tenant: str | None,
                 images: tuple[ImageInput, ...] = ()) -> int:
        cache = getattr(self.engine, "cache", None)
        if tenant is None or cache is None:
            return 0
        try:
            ns = self.engine.namespace(tenant)
            match = (cache.lookup(tokens, ns, image_extra_keys(images)) if images
                     else cache.lookup(tokens, ns))
            return max(0, min(int(match.num_tokens), len(tokens) - 1))
        except Exception:  # a prediction only; never fails the request
            log.debug("cache lookup for the usage prediction failed", exc_info=True)
            return 0


# --- the context-window policy ----------------------------------------------------------


def context_window(st: ServerState) -> int:
    """The window the server enforces: the model's, or ``--context-window`` if smaller."""
    model = int(st.engine.context_length)
    override = st.config.context_window
    return min(model, override) if override else model


def max_output_tokens(st: ServerState) -> int:
    return min(st.engine_config.max_tokens_limit, context_window(st))


def plan_max_tokens(st: ServerState, api: str, prompt_len: int, requested: int | None,
                    param: str = "max_tokens") -> int:
    """max_tokens for a prompt of ``prompt_len`` tokens, or the API's own error.

    - The prompt alone fills the window: Anthropic ``prompt is too long: {n} tokens >
      {window} maximum`` (Claude Code compacts), OpenAI ``context_length_exceeded``
      with its usual message.
    - No max_tokens: the server default (``--default-max-tokens``), within the room left.
    - prompt + max_tokens past the window: clamped to the room left (the reply ends with
      ``max_tokens`` / ``length`` there), or with ``max_tokens_overflow="error"``
      Anthropic ``input length and `max_tokens` exceed context limit: {n} + {m} >
      {window}, ...`` (Claude Code retries with a smaller max_tokens) / OpenAI
      ``context_length_exceeded``."""
    window = context_window(st)
    anthropic = api == "anthropic"
    if prompt_len == 0:
        raise APIError(400, "the prompt is empty", code="invalid_request")
    if prompt_len >= window:
        if anthropic:
            raise APIError(400, f"prompt is too long: {prompt_len} tokens > {window} maximum",
                           code="context_length_exceeded")
        raise APIError(400, f"This model's maximum context length is {window} tokens. "
                            f"However, your messages resulted in {prompt_len} tokens. "
                            "Please reduce the length of the messages.",
                       code="context_length_exceeded", param="messages")
    room = window - prompt_len
    if requested is None:
        return max(1, min(st.engine_config.default_max_tokens, room))
    if isinstance(requested, bool) or requested <= 0:
        raise APIError(400, f"{param} must be > 0, got {requested}", param=param)
    limit = st.engine_config.max_tokens_limit
    if requested > limit:
        raise APIError(400, f"{param} must be <= {limit}, got {requested}", param=param)
    if requested <= room:
        return requested
    if st.config.max_tokens_overflow == "clamp":
        return room
    if anthropic:
        raise APIError(400, f"input length and `max_tokens` exceed context limit: {prompt_len} "
                            f"+ {requested} > {window}, decrease input length or `max_tokens` "
                            "and try again", code="context_length_exceeded")
    raise APIError(400, f"This model's maximum context length is {window} tokens. However, "
                        f"you requested {prompt_len + requested} tokens ({prompt_len} in the "
                        f"messages, {requested} in the completion). Please reduce the length "
                        "of the messages or completion.",
                   code="context_length_exceeded", param="messages")


# --- the reply pump ---------------------------------------------------------------------


def reply_parser(prepared: Prepared) -> ReplyParser:
    cf = prepared.chat_format
    return ReplyParser(cf.think_start, cf.think_end, in_reasoning=prepared.in_reasoning,
                       tool_names=prepared.tool_names,
                       tool_format=prepared.tool_format or cf.tools_format(False),
                       tools=prepared.tools)


@dataclass(frozen=True)
class Finished:
    """The end of a reply: the engine's result, the tool calls, the whole reasoning and
    answer text (exactly what was streamed)."""

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
    """One reply as the APIs send it: ``Piece``s (reasoning / text, as safe to send),
    the ``TokenEvent``s that carry logprobs, ``KEEPALIVE`` ticks (with ``keepalive_s``),
    and last ``Finished``. Streaming and non-streaming handlers both consume this."""
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
        if parser.splitter.in_reasoning:
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
    """OpenAI logprob entries (``{"token", "logprob", "bytes", "top_logprobs"}``) from
    ``TokenEvent``s; token strings are decoded in a worker thread (memoised). The token
    that ended the reply (EOS or a requested stop token id) is not content and has no
    entry, as in OpenAI's API."""

    def __init__(self, tokenizer: Any, stop_token_ids: Sequence[int] = ()) -> None:
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
            # JSON has no -inf: a token a constraint masked out is left out of the
            # alternatives (OpenAI writes -9999.0 for a probability of zero)
            entry = self._entry(ev.token_id, lp if math.isfinite(lp) else -9999.0)
            entry["top_logprobs"] = [self._entry(t, alt) for t, alt in ev.top_logprobs
                                     if math.isfinite(alt)]
            out.append(entry)
        return out
