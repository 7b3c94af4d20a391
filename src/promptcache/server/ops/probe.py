"""``POST /v1/cache/probe``: what the cache holds for a request, without generating. The body is
prepared exactly as a real turn and looked up as a pure query (nothing promoted, stored or
counted); the answer is described in docs/api.md."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ValidationError

from ...engine.api import image_extra_keys
from ..api import anthropic, openai, responses
from ..api.errors import APIError, json_object
from ..api.schemas import ChatCompletionRequest, MessagesRequest, ResponsesRequest
from ..prompts.prepared import Prepared, TurnContext
from ..prompts.preparer import Preparer, preparer_of
from ..replies.runner import state_of
from .diagnostics import (
    CONTEXT_TOKENS,
    MESSAGES_CHANGED,
    SYSTEM_CHANGED,
    TOOLS_CHANGED,
    Divergence,
    body_texts,
    locate,
    message_at,
)

log = logging.getLogger(__name__)
router = APIRouter()

APIS = ("chat", "messages", "responses")


def detect_api(body: dict[str, Any], headers: Any) -> str:
    if any(k in body for k in ("input", "instructions", "previous_response_id")):
        return "responses"
    if "anthropic-version" in headers or "system" in body:
        return "messages"
    return "chat"


def _parse(model: type[BaseModel], raw: dict[str, Any]) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"invalid {model.__name__} body: {where}: {first.get('msg')}",
                       param=where or None) from e


def cache_miss_reason(cause: str | None, in_tools: bool, message_index: int | None,
                      role: str | None) -> str | None:
    """A cache cause in Anthropic's terms: a divergence is named by where it falls."""
    if cause is None:
        return None
    if cause != "diverged":
        return cause
    if in_tools:
        return TOOLS_CHANGED
    if message_index == 0 and role == "system":
        return SYSTEM_CHANGED
    return MESSAGES_CHANGED


def _previous(div: Divergence) -> dict[str, Any] | None:
    if div.not_found:
        return {"found": False}
    if not div.previous:
        return None
    diverged = div.position < div.reachable
    return {"found": True, "reusable_tokens": div.reachable,
            "diverges_at": div.position if diverged else None,
            "change": div.changed if diverged else None,
            "message_index": div.message_index, "block": div.block}


def analyse(prep: Preparer, prepared: Prepared, tenant: str, source: Any) -> dict[str, Any]:
    """The probe's answer (worker thread: a render, decoding; the cache lookup runs on
    the engine thread, ``CachePortAPI.probe_cache``)."""
    engine = prep.engine
    tokens = prepared.tokens
    n = len(tokens)
    out: dict[str, Any] = {"prompt_tokens": n, "cached_tokens": 0, "cached_by_tier": {},
                           "matched_tokens": 0, "divergence": None, "cause": None,
                           "cache_miss_reason": None, "restore_plan": None,
                           "previous_turn": _previous(prepared.divergence)}
    extra = image_extra_keys(prepared.images)
    match = engine.cache_port.probe_cache(tokens, tenant, extra, CONTEXT_TOKENS) \
        if engine.cache is not None else None
    if match is None:  # no cache (or its lookup failed)
        out["cause"] = out["cache_miss_reason"] = "unavailable"
        return out
    cached = max(0, min(int(match.num_tokens), n - 1))
    by_tier: dict[str, int] = {}
    left = cached
    for tier, count in match.tokens_by_tier.items():
        take = min(int(count), left)
        if take > 0:
            by_tier[str(tier)] = take
        left -= take
    out.update(cached_tokens=cached, cached_by_tier=by_tier,
               matched_tokens=int(match.matched_tokens),
               restore_plan=dict(match.restore_plan) if match.restore_plan else None)
    miss = match.miss
    if miss is None:
        return out
    position = min(int(miss.position), n)
    idx = message_at(position, prepared.message_starts)
    role = str(prepared.messages[idx].get("role")) \
        if idx is not None and idx < len(prepared.messages) else None
    stored = list(match.stored_after)
    decode = engine.tokenizer.decode
    common = str(decode(tokens[max(0, position - CONTEXT_TOKENS):position]))
    request_text = str(decode(tokens[position:position + CONTEXT_TOKENS]))
    span = prep.tools_span(prepared)
    in_tools = span is not None and span[0] <= position < span[1]
    out["divergence"] = {
        "token_index": position, "message_index": idx, "role": role,
        "block": locate(common, request_text, body_texts(source)),
        "in_tools": in_tools, "common_text": common,
        "cached_text": str(decode(stored)) if stored else "",
        "request_text": request_text,
    }
    out["cause"] = miss.cause
    out["cache_miss_reason"] = cache_miss_reason(miss.cause, in_tools, idx, role)
    return out


@router.post("/v1/cache/probe")
async def probe(request: Request, api: str | None = None, tokens: bool = False
                ) -> dict[str, Any]:
    st = state_of(request)
    raw = await json_object(request)
    kind = api or detect_api(raw, request.headers)
    if kind not in APIS:
        raise APIError(400, f"api must be one of {', '.join(APIS)}, got {kind!r}", param="api")
    model = raw.get("model")
    st.check_model(model if isinstance(model, str) else None)
    preparer = preparer_of(request)
    scope = request.state.pc_scope
    previous, named = None, False
    if kind == "messages":
        body = _parse(MessagesRequest, {"max_tokens": 1, **raw})
        chat = anthropic.chat_prompt(body, preparer.canon, st.image_collector())
        diag = body.diagnostics or {}
        previous, named = diag.get("previous_message_id"), "previous_message_id" in diag
    elif kind == "responses":
        body = _parse(ResponsesRequest, raw)
        scope = scope.with_session(body.prompt_cache_key, "prompt_cache_key")
        chat = responses.chat_prompt(body, responses.store_of(request),
                                     st.image_collector())[2]
    else:
        body = _parse(ChatCompletionRequest, raw)
        scope = scope.with_session(body.prompt_cache_key, "prompt_cache_key")
        chat = openai.chat_prompt(body, st.image_collector())
    turn = TurnContext.of(scope, previous if isinstance(previous, str) else None, named)
    prepared = await preparer.prepare(chat, turn=turn)
    out = await preparer.run(analyse, preparer, prepared, scope.tenant, body)
    log.info("cache probe (%s, tenant=%s %s): %d of %d tokens cached, cause %s", kind,
             scope.tenant, scope.describe(), out["cached_tokens"], out["prompt_tokens"],
             out["cache_miss_reason"] or "-")
    answer = {"api": kind, "model": st.model_id, "tenant": scope.tenant,
              "session_id": scope.session_id, **out,
              "canonicalization": list(preparer.canon.active)}
    if tokens:
        answer["tokens"] = prepared.tokens
        answer["message_starts"] = prepared.message_starts
    return answer
