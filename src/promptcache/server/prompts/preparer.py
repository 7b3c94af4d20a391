"""``Preparer.prepare(chat)``: the one place a parsed request becomes a ``Prepared`` prompt
(rules, template, tokens, breakpoints, images, constraint, comparison, prediction), in one
worker thread per app (the fast tokenizer is not thread-safe). ``preparer_of(request)``."""

from __future__ import annotations

import asyncio
import logging
import threading
from array import array
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

from ...engine.api import (
    GenerationResult,
    ImageInput,
    common_prefix,
    expand_placeholders,
    image_extra_keys,
)
from ...engine.formats.chat_format import ChatFormat
from ...engine.port import CachePrediction, EngineAPI
from ...errors import TemplateRenderError
from ..api.errors import APIError
from ..ops.diagnostics import (
    NO_PREVIOUS,
    PREVIOUS_NOT_FOUND,
    Divergence,
    Fingerprint,
    Turn,
    TurnKey,
    TurnStore,
    compare,
)
from ..replies.toolcalls import offered_tool_names
from .canon import Canon
from .prepared import ChatPrompt, Prepared, TurnContext
from .prompt import place_system_messages, tools_into_system
from .structured import (
    ForcedCall,
    PromptShape,
    check_constraint,
    constraint_for,
    thinking_for,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


def preparer_of(request: Request) -> Preparer:
    prep: Preparer = request.app.state.pc_prepare
    return prep


@dataclass(frozen=True)
class TemplateAbilities:
    mid_system: bool  # renders a system turn after other turns
    tools: bool  # renders the ``tools`` it is given


_PROBE_TOOL = {"type": "function", "function": {
    "name": "promptcache_probe", "description": "probe",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
_PROBE_TEXT = "promptcache-probe-7d1f"


class Preparer:
    def __init__(self, engine: EngineAPI, canon: Canon | None = None,
                 turns: TurnStore | None = None,
                 on_template_error: Callable[[str], None] = lambda cause: None) -> None:
        self.engine = engine
        self.on_template_error = on_template_error  # a failed render's cause (/metrics)
        self.canon = canon if canon is not None else Canon()
        self.turns = turns if turns is not None else TurnStore()
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._abilities: TemplateAbilities | None = None
        self.chat_format: ChatFormat = engine.chat_format

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
        return await asyncio.get_running_loop().run_in_executor(self._executor(), fn, *args)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` on the worker thread (in order with later preparations)."""
        future = self._executor().submit(fn, *args)
        future.add_done_callback(_log_failure)

    async def prepare(self, chat: ChatPrompt, *, predict_tenant: str | None = None,
                      turn: TurnContext | None = None, generate: bool = False) -> Prepared:
        """``generate``: the engine is told meanwhile, so a burst prefills as one batch."""
        release = self.engine.announce() if generate else None
        try:
            return await self.run(self._prepare, chat, predict_tenant, turn)
        finally:
            if release is not None:
                release()

    def record_turn(self, prepared: Prepared, turn: TurnContext, message_id: str | None,
                    result: GenerationResult) -> None:
        """Remember a finished turn for the next one's comparison (queued on the worker)."""
        if prepared.fingerprint is None or result.finish_reason in ("error", "cancelled"):
            return
        if turn.key is None and message_id is None:
            return
        self.submit(self._record, prepared.fingerprint, prepared.tokens, result.tokens,
                    turn.key, message_id, turn.tenant)

    def _record(self, fp: Fingerprint, prompt: list[int], output: list[int],
                key: TurnKey | None, message_id: str | None, tenant: str | None) -> None:
        tokens = array("I", prompt)
        tokens.extend(output)
        self.turns.add(Turn(key, fp, tokens, tenant), message_id)

    async def count(self, chat: ChatPrompt) -> int:
        prepared = await self.prepare(chat)
        return len(prepared.tokens)

    def _render(self, messages: list[dict[str, Any]], tools: Any, *, cont: bool = False,
                kwargs: dict[str, Any] | None = None, offsets: bool = False
                ) -> tuple[list[int], list[int]]:
        engine = self.engine
        opts: dict[str, Any] = {}
        if cont:
            opts["continue_final_message"] = True
        if kwargs:
            opts["template_kwargs"] = kwargs
        if offsets:
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
        """``light``: tokens only (no offsets, lookup or comparison), for the pre-render."""
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
        except TemplateRenderError as e:  # the template's own fault (syntax, loop): ours
            self.on_template_error(e.cause)
            raise APIError(500, f"cannot render the chat template: {e}",
                           code="template_error") from e
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
        prediction = self._predict(tokens, predict_tenant, images)
        return Prepared(tokens=tokens, message_starts=starts, tool_names=names,
                        tools_in_system=in_system, continues=cont,
                        in_reasoning=in_reasoning,
                        predicted_cached=prediction.num_tokens,
                        predicted_whole=prediction.whole, chat_format=self.chat_format,
                        images=images, tool_format=fmt, tools=chat.tools or None,
                        constraint=constraint,
                        forced_call=constraint is not None
                        and isinstance(chat.structure, ForcedCall),
                        messages=messages, plain_messages=plain,
                        template_kwargs=kwargs, fingerprint=fingerprint,
                        divergence=self._divergence(turn, fingerprint, tokens, starts,
                                                    messages, chat.source),
                        predicted_cause=prediction.cause, breakpoints=bps)

    def _positions(self, chat: ChatPrompt, canonical: list[dict[str, Any]], dropped: int,
                   tokens: list[int], starts: list[int], rendered: list[dict[str, Any]]
                   ) -> tuple[tuple[int, float], ...]:
        """Token positions of the breakpoints (worker thread): the system prompt ends
        where message 1 starts, the last message at the prompt's end, another message
        where the prompt leaves a rendering of the messages up to it + a placeholder."""
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
        """Where the prompt leaves the rendering of ``head`` + a placeholder (a light render)."""
        nxt = ChatPrompt([*head, {"role": "user", "content": "Alpha (the next message)"}],
                         chat.tools, chat.thinking)
        return common_prefix(self._prepare(nxt, None, None, light=True).tokens, tokens)

    def tools_span(self, prepared: Prepared) -> tuple[int, int] | None:
        """``[start, end)`` of the tokens the tools add (worker thread): what lies between
        the prefix and suffix shared with the prompt rendered without tools. None without."""
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
            prev = self.turns.by_id(turn.previous_message_id, turn.tenant)
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
                 images: tuple[ImageInput, ...] = ()) -> CachePrediction:
        """Predicted cached tokens (a lookup on the engine thread), the miss's cause and
        whether the whole prompt is stored; nothing cached without a cache or when the
        lookup fails or times out (never fails the request)."""
        if tenant is None or self.engine.cache is None:
            return CachePrediction(0)
        try:
            got = self.engine.cache_port.predict_cached(tokens, tenant, image_extra_keys(images))
        except Exception:  # an engine that raises instead of degrading
            log.debug("cache lookup for the usage prediction failed", exc_info=True)
            got = None
        if got is None:
            return CachePrediction(0)
        return CachePrediction(max(0, min(got.num_tokens, len(tokens) - 1)), got.cause,
                               whole=got.whole)


def _shift_past_images(positions: tuple[tuple[int, float], ...],
                       images: tuple[ImageInput, ...]) -> tuple[tuple[int, float], ...]:
    """Breakpoints in the rendered prompt (one token per image) -> in the expanded prompt."""
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
