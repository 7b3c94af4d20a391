"""A turn's life: ``start`` (submit; when it ends, remember it for the next turn's comparison
and report what the cache did), ``after_reply`` (claim what the turn wants kept, schedule
the next-turn pre-render), ``retention_of`` and ``plan_max_tokens`` (the context-window
policy, in the wordings clients parse)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Request

from ...engine.api import GenerationResult, SamplingParams, image_extra_keys
from ...engine.port import EngineAPI
from ..api.auth import Scope
from ..api.errors import APIError
from ..ops.diagnostics import TurnKey, cache_cause_of
from ..ops.outcome import MISS, Outcome, outcome_of
from ..replies.runner import Generation, ServerState
from .prepared import ChatPrompt, Prepared, TurnContext
from .preparer import preparer_of
from .prerender import PreRenderer

log = logging.getLogger(__name__)


# --- starting a turn ----------------------------------------------------------------------


def caching(st: ServerState) -> bool:
    return st.engine.cache is not None


def prerenderer_of(request: Request) -> PreRenderer | None:
    pre: PreRenderer | None = request.app.state.pc.prerender
    return pre


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

    def on_result(result: GenerationResult) -> tuple[Outcome, str | None]:
        prep.record_turn(prepared, turn, message_id, result)
        u = result.usage
        outcome = outcome_of(u.prompt_tokens, u.cached_tokens + u.recomputed_tokens, result.miss,
                             cached_by_tier=u.served_by_tier, caching=cache_on,
                             divergence=prepared.divergence,
                             last_message_start=prepared.message_starts[-1]
                             if prepared.message_starts else None)
        if outcome.word != MISS:
            return outcome, None
        cause = cache_cause_of(result.miss)
        diagnosis = prepared.divergence.diagnose(u.cached_tokens, cause, cache_on)
        if diagnosis is None:
            return outcome, result.miss_reason
        return outcome, prepared.divergence.log_text(diagnosis, result.miss_reason)

    gen.on_result = on_result
    return gen


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
    """Tell the cache what this turn wants kept, queued in the preparation worker (each call
    runs on the engine thread after the turn's stores): each Anthropic breakpoint protected (and
    persisted) for its ttl; with a prompt_cache_key the whole chain for ``KEY_PROTECT_S`` (persisted
    only with ``prompt_cache_retention: 24h``); with a session its chain marked the latest. A failed
    call is logged and counted by the engine; the reply is already sent."""
    if result.finish_reason in ("error", "cancelled"):
        return
    engine: EngineAPI = request.app.state.pc.engine
    if engine.cache is None:
        return
    port = engine.cache_port
    breakpoints = list(prepared.breakpoints)
    if not breakpoints and key is None:
        return
    tokens = list(prepared.tokens) + list(result.tokens)
    extra = image_extra_keys(prepared.images)  # the images' digests are in the block keys

    def apply() -> None:
        for pos, ttl in breakpoints:
            port.protect(tokens, tenant, min(pos, len(tokens)), ttl, extra_keys=extra)
        if chat.retention is not None and key is not None:
            port.protect(tokens, tenant, len(tokens), KEY_PROTECT_S, key=key.activity,
                         persist=chat.retention == "24h", extra_keys=extra,
                         pin_s=86400.0 if chat.retention == "24h" else None)
        if key is not None:
            port.mark_active(tokens, tenant, key.activity, extra_keys=extra)

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
    - prompt + max_tokens past the window, or max_tokens past ``--max-tokens-limit``:
      clamped to the room left and the limit (the reply ends with ``max_tokens`` /
      ``length`` there), or with ``max_tokens_overflow="error"`` a 400: ``{param} must be
      <= {limit}`` past the limit, else Anthropic ``input length and `max_tokens` exceed
      context limit: {n} + {m} > {window}, ...`` (Claude Code retries with a smaller
      max_tokens) / OpenAI ``context_length_exceeded``."""
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
    if requested <= min(limit, room):
        return requested
    if st.config.max_tokens_overflow == "clamp":
        return min(limit, room)
    if requested > limit:
        raise APIError(400, f"{param} must be <= {limit}, got {requested}", param=param)
    if anthropic:
        raise APIError(400, f"input length and `max_tokens` exceed context limit: {prompt_len} "
                            f"+ {requested} > {window}, decrease input length or `max_tokens` "
                            "and try again", code="context_length_exceeded")
    raise APIError(400, f"This model's maximum context length is {window} tokens. However, "
                        f"you requested {prompt_len + requested} tokens ({prompt_len} in the "
                        f"messages, {requested} in the completion). Please reduce the length "
                        "of the messages or completion.",
                   code="context_length_exceeded", param="messages")
