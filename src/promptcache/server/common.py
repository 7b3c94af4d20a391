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
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from ..engine.api import (
    Constraint,
    GenerationResult,
    ImageInput,
    SamplingParams,
    TokenEvent,
    expand_placeholders,
    image_extra_keys,
)
from ..engine.chat_format import ChatFormat, ToolCallFormat
from .auth import Scope
from .canon import Canon
from .diagnostics import (
    NO_PREVIOUS,
    PREVIOUS_NOT_FOUND,
    Divergence,
    Fingerprint,
    Turn,
    TurnKey,
    TurnStore,
    cache_cause_of,
    common_prefix,
    compare,
)
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
    # the request body as sent (miss explanations name the part of it a divergence
    # falls in); never rendered
    source: Any = field(default=None, compare=False, repr=False)
    # the client's cache breakpoints (Anthropic cache_control)
    breakpoints: tuple[Breakpoint, ...] = ()
    # OpenAI prompt_cache_key was sent: keep the turn's chain, ``in_memory`` (RAM) or
    # ``24h`` (RAM + written to the lower tiers at once); None: no such request
    retention: str | None = None


@dataclass(frozen=True)
class Breakpoint:
    """A client's cache breakpoint: keep the prefix up to the end of the leading system
    prompt (``message=None``: ``cache_control`` on a system block or a tool) or of
    template message ``message``, for ``ttl_s`` seconds."""

    message: int | None
    ttl_s: float


@dataclass(frozen=True)
class TurnContext:
    """Who asks, for the comparison with the previous turn (``diagnostics.py``)."""

    key: TurnKey | None = None
    # Anthropic ``diagnostics.previous_message_id`` (``named_previous``: the field was
    # sent, possibly null)
    previous_message_id: str | None = None
    named_previous: bool = False

    @classmethod
    def of(cls, scope: Scope, previous_message_id: str | None = None,
           named_previous: bool = False) -> TurnContext:
        key = TurnKey(scope.tenant, scope.session_id, scope.agent_id) \
            if scope.session_id else None
        return cls(key, previous_message_id, named_previous)


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
    # the tools the request offers, as sent (the reply parser reads calls with them)
    tools: list[dict[str, Any]] | None = None
    # constrained decoding for the request's ``structure`` (compiled, checked)
    constraint: Constraint | None = None
    # the template messages as rendered (after system placement and the tools fallback)
    messages: list[dict[str, Any]] = field(default_factory=list)
    # the messages before the tools fallback, and the template variables (to render
    # the same prompt without its tools: ``Preparer.tools_span``)
    plain_messages: list[dict[str, Any]] = field(default_factory=list)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    fingerprint: Fingerprint | None = None
    # this request against the previous turn of its session (diagnostics.py)
    divergence: Divergence = NO_PREVIOUS
    # the cache's cause of a short predicted match (with ``predicted_cached``)
    predicted_cause: str | None = None
    # the breakpoints as token positions: ((end, ttl seconds), ...) by position
    breakpoints: tuple[tuple[int, float], ...] = ()


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

    def __init__(self, engine: Any, canon: Canon | None = None,
                 turns: TurnStore | None = None) -> None:
        self.engine = engine
        self.canon = canon if canon is not None else Canon()
        self.turns = turns if turns is not None else TurnStore()
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

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` on the worker thread without waiting (in order with the
        preparations queued after it)."""
        future = self._executor().submit(fn, *args)
        future.add_done_callback(_log_failure)

    async def prepare(self, chat: ChatPrompt, *, predict_tenant: str | None = None,
                      turn: TurnContext | None = None) -> Prepared:
        return await self.run(self._prepare, chat, predict_tenant, turn)

    def record_turn(self, prepared: Prepared, turn: TurnContext, message_id: str | None,
                    result: GenerationResult) -> None:
        """Remember a finished turn (prompt + output) for the next turn's comparison;
        queued on the worker thread, before any later preparation."""
        if prepared.fingerprint is None or result.finish_reason in ("error", "cancelled"):
            return
        if turn.key is None and message_id is None:
            return
        self.submit(self._record, prepared.fingerprint, prepared.tokens, result.tokens,
                    turn.key, message_id)

    def _record(self, fp: Fingerprint, prompt: list[int], output: list[int],
                key: TurnKey | None, message_id: str | None) -> None:
        tokens = array("I", prompt)
        tokens.extend(output)
        self.turns.add(Turn(key, fp, tokens), message_id)

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

    def _prepare(self, chat: ChatPrompt, predict_tenant: str | None,
                 turn: TurnContext | None = None, *, light: bool = False) -> Prepared:
        """``light``: tokens only (no message offsets, no lookup, no comparison): what
        the next-turn pre-render needs."""
        if not chat.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        ab = self.abilities()
        canonical = self.canon.messages(chat.messages)
        if not canonical:
            raise APIError(400, "messages must not be empty", param="messages")
        tools = self.canon.tools(chat.tools or None)
        fingerprint = Fingerprint.of(canonical, tools)
        messages = place_system_messages(canonical, ab.mid_system)
        names = offered_tool_names(tools)
        plain = messages
        in_system = False
        if tools and not ab.tools:
            messages, tools, in_system = tools_into_system(messages, tools), None, True
        cont = messages[-1]["role"] == "assistant"
        kwargs = self.chat_format.thinking_kwargs(thinking_for(chat.structure, chat.thinking))
        try:
            tokens, starts = self._render(messages, tools, cont=cont, kwargs=kwargs,
                                          offsets=not light)
        except (ValueError, APIError):
            raise
        except Exception as e:  # jinja TemplateError & co: caused by the request's messages
            raise APIError(400, f"cannot render the chat template for these messages: {e}",
                           code="invalid_messages", param="messages") from e
        if light:
            turn = None
        dropped = len(chat.messages) - len(canonical)  # a leading billing-header message
        bps = () if light else self._positions(chat, canonical, dropped, tokens, starts,
                                               messages)
        images: tuple[ImageInput, ...] = ()
        if chat.images is not None and chat.images.sources and not light:
            decoded = chat.images.decode()  # APIError 400 for a bad image
            try:
                tokens, new_starts, images = expand_placeholders(
                    tokens, starts, chat.images.info, decoded)
            except ValueError as e:
                raise APIError(400, str(e), code="invalid_image", param="messages") from None
            starts = list(new_starts)
            bps = _shift_past_images(bps, images)
        in_reasoning = False if light else self._ends_in_reasoning(tokens)
        fmt = self.chat_format.tools_format(ab.tools)
        constraint = None
        if chat.structure is not None and not light:
            prefill = messages[-1].get("content") if cont else None
            constraint = constraint_for(chat.structure, PromptShape(
                self.chat_format, fmt, chat.tools, in_reasoning=in_reasoning,
                may_reason=chat.thinking is True,
                prefill=prefill if isinstance(prefill, str) else None))
            if constraint is not None:
                check_constraint(constraint, self.engine, chat.structure.param)
        predicted, cause = self._predict(tokens, predict_tenant, images)
        return Prepared(tokens=tokens, message_starts=starts, tool_names=names,
                        tools_in_system=in_system, continues=cont,
                        in_reasoning=in_reasoning,
                        predicted_cached=predicted, chat_format=self.chat_format,
                        images=images, tool_format=fmt, tools=chat.tools or None,
                        constraint=constraint,
                        messages=messages, plain_messages=plain,
                        template_kwargs=kwargs, fingerprint=fingerprint,
                        divergence=self._divergence(turn, fingerprint, tokens, starts,
                                                    messages, chat.source),
                        predicted_cause=cause, breakpoints=bps)

    def _positions(self, chat: ChatPrompt, canonical: list[dict[str, Any]], dropped: int,
                   tokens: list[int], starts: list[int], rendered: list[dict[str, Any]]
                   ) -> tuple[tuple[int, float], ...]:
        """Token positions of the breakpoints (worker thread). The end of the system
        prompt is where rendered message 1 starts; the end of the last message is the
        prompt's end; another message's end is where the prompt leaves a rendering of
        the messages up to it + a placeholder message."""
        out: dict[int, float] = {}
        last = len(canonical) - 1
        for bp in chat.breakpoints:
            index = None if bp.message is None else bp.message - dropped
            if index is not None and index < 0:
                continue
            if index is None or (index == 0 and canonical[0].get("role") == "system"
                                 and last > 0):
                if not rendered or rendered[0].get("role") != "system" or len(starts) < 2:
                    continue
                pos = starts[1]
            elif index >= last:
                pos = len(tokens)
            else:
                pos = self._message_end(chat, canonical[:index + 1], tokens)
            out[pos] = max(out.get(pos, 0.0), bp.ttl_s)
        return tuple(sorted(out.items()))

    def _message_end(self, chat: ChatPrompt, head: list[dict[str, Any]],
                     tokens: list[int]) -> int:
        """Where the prompt leaves the rendering of ``head`` + a placeholder message:
        the end of ``head``'s last message as this template renders it (one light
        render)."""
        nxt = ChatPrompt([*head, {"role": "user", "content": "Alpha (the next message)"}],
                         chat.tools, chat.thinking)
        return common_prefix(self._prepare(nxt, None, None, light=True).tokens, tokens)

    def tools_span(self, prepared: Prepared) -> tuple[int, int] | None:
        """``[start, end)`` of the tokens the tools add to ``prepared`` (worker thread):
        the prompt rendered without tools shares a prefix and a suffix with it; what
        lies between is theirs. None without tools."""
        if not prepared.tool_names:
            return None
        without, _ = self._render(prepared.plain_messages, None, cont=prepared.continues,
                                  kwargs=prepared.template_kwargs)
        tokens = prepared.tokens
        head = 0
        for a, b in zip(tokens, without, strict=False):
            if a != b:
                break
            head += 1
        tail = 0
        limit = min(len(tokens), len(without)) - head
        while tail < limit and tokens[-1 - tail] == without[-1 - tail]:
            tail += 1
        return head, len(tokens) - tail

    def _divergence(self, turn: TurnContext | None, fp: Fingerprint, tokens: list[int],
                    starts: list[int], messages: list[dict[str, Any]], body: Any
                    ) -> Divergence:
        if turn is None:
            return NO_PREVIOUS
        if turn.previous_message_id is not None:
            prev = self.turns.by_id(turn.previous_message_id)
            if prev is None:
                return PREVIOUS_NOT_FOUND
        elif turn.named_previous or turn.key is None:
            return NO_PREVIOUS  # an explicit null: the first turn
        else:
            prev = self.turns.last(turn.key)
        try:
            return compare(prev, fp, tokens, starts, [str(m.get("role")) for m in messages],
                           self.engine.tokenizer.decode, body)
        except Exception:  # a diagnosis only; never fails the request
            log.warning("comparing with the previous turn failed", exc_info=True)
            return NO_PREVIOUS

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
                 images: tuple[ImageInput, ...] = ()) -> tuple[int, str | None]:
        cache = getattr(self.engine, "cache", None)
        if tenant is None or cache is None:
            return 0, None
        try:
            ns = self.engine.namespace(tenant)
            match = (cache.lookup(tokens, ns, image_extra_keys(images)) if images
                     else cache.lookup(tokens, ns))
            miss = getattr(match, "miss", None)
            return (max(0, min(int(match.num_tokens), len(tokens) - 1)),
                    getattr(miss, "cause", None))
        except Exception:  # a prediction only; never fails the request
            log.debug("cache lookup for the usage prediction failed", exc_info=True)
            return 0, None


def _shift_past_images(positions: tuple[tuple[int, float], ...],
                       images: tuple[ImageInput, ...]) -> tuple[tuple[int, float], ...]:
    """Breakpoint positions found in the rendered prompt (one token per image) ->
    positions in the expanded prompt (``ImageInput.length`` placeholders per image)."""
    if not images:
        return positions
    # each image's token position in the rendered prompt, and how much it grew
    where = [(im.start - k * (im.length - 1), im.length - 1) for k, im in enumerate(images)]
    return tuple((pos + sum(grow for at, grow in where if at < pos), ttl)
                 for pos, ttl in positions)


def _log_failure(future: Any) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("a background task of the preparation worker failed",
                    exc_info=future.exception())


# --- starting a turn ----------------------------------------------------------------------


def caching(st: ServerState) -> bool:
    return getattr(st.engine, "cache", None) is not None


def prerenderer_of(request: Request) -> Any:
    return getattr(request.app.state, "pc_prerender", None)


def start(st: ServerState, api: str, request: Request, scope: Scope, prepared: Prepared,
          sampling: SamplingParams, turn: TurnContext, *, message_id: str | None = None
          ) -> Generation:
    """Submit a prepared turn. When it ends, the turn is remembered for the next one's
    comparison and the request log line names a miss with its facts. A pending
    pre-render of the same session is cancelled (this request supersedes it)."""
    pre = prerenderer_of(request)
    if pre is not None:
        pre.cancel(turn.key)
    gen = st.start(api, request, scope, prepared.tokens, sampling, prepared.message_starts,
                   images=prepared.images, constraint=prepared.constraint)
    prep = preparer_of(request)
    cache_on = caching(st)

    def on_result(result: GenerationResult) -> str | None:
        cause = cache_cause_of(result.miss_reason)
        diagnosis = prepared.divergence.diagnose(result.usage.cached_tokens, cause, cache_on)
        prep.record_turn(prepared, turn, message_id, result)
        if diagnosis is None:
            return result.miss_reason
        return prepared.divergence.log_text(diagnosis, result.miss_reason)

    gen.on_result = on_result
    return gen


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


def after_reply(request: Request, gen: Generation, turn: TurnContext, prepared: Prepared,
                chat: ChatPrompt, reply: list[dict[str, Any]]) -> None:
    """A reply was sent: ``reply`` is it as template messages, exactly as this API's
    parser reads the client's echo. Schedules the next-turn pre-render (prerender.py)."""
    pre = prerenderer_of(request)
    result = gen.result
    if result is None:
        return
    claim_chain(request, gen.scope.tenant, turn.key, prepared, chat, result)
    if pre is None:
        return
    try:
        pre.after_reply(turn.key, gen.scope.tenant, gen.scope.session_id, chat, reply,
                        prepared, result)
    except Exception:  # an optimisation: never fails the response
        log.warning("scheduling the next-turn pre-render failed", exc_info=True)


# seconds a prompt_cache_key chain stays protected in RAM after its last turn (OpenAI:
# in-memory retention lasts 5-10 minutes of inactivity)
KEY_PROTECT_S = 600.0
RETENTIONS = ("in_memory", "24h")


def claim_chain(request: Request, tenant: str, key: TurnKey | None, prepared: Prepared,
                chat: ChatPrompt, result: GenerationResult) -> None:
    """Tell the cache what this turn wants kept (in the preparation worker, in order
    with the next preparations; never on the event loop): each Anthropic breakpoint is
    protected for its ttl (``PromptCache.protect``, persisted at once); with a
    prompt_cache_key the turn's whole chain (prompt + output) replaces the key's
    previous chain for ``KEY_PROTECT_S``, written to the lower tiers at once only with
    ``prompt_cache_retention: 24h``; a turn with a session marks its chain as the
    session's latest (``PromptCache.mark_active``)."""
    if result.finish_reason in ("error", "cancelled"):
        return
    engine = request.app.state.pc.engine
    cache = getattr(engine, "cache", None)
    if cache is None or not hasattr(cache, "protect"):
        return
    breakpoints = list(prepared.breakpoints)
    if not breakpoints and key is None:
        return
    tokens = list(prepared.tokens) + list(result.tokens)
    extra = image_extra_keys(prepared.images)  # the images' digests are in the block keys

    def apply() -> None:
        ns = engine.namespace(tenant)
        for pos, ttl in breakpoints:
            cache.protect(tokens, ns, min(pos, len(tokens)), ttl, extra_keys=extra)
        if chat.retention is not None and key is not None:
            cache.protect(tokens, ns, len(tokens), KEY_PROTECT_S, key=key.activity,
                          persist=chat.retention == "24h", extra_keys=extra,
                          pin_s=86400.0 if chat.retention == "24h" else None)
        if key is not None:
            cache.mark_active(tokens, ns, key.activity, extra_keys=extra)

    preparer_of(request).submit(apply)


def retention_of(body: Any) -> str | None:
    """``in_memory`` / ``24h`` for a request with a prompt_cache_key (the default:
    ``in_memory``); None without one. A bad value is a 400."""
    value = (getattr(body, "model_extra", None) or {}).get("prompt_cache_retention")
    if value is not None and value not in RETENTIONS:
        raise APIError(400, f"prompt_cache_retention must be one of {', '.join(RETENTIONS)}, "
                            f"got {value!r}", param="prompt_cache_retention")
    if getattr(body, "prompt_cache_key", None) is None:
        return None
    return str(value or "in_memory")
