"""What every API module (openai.py, responses.py, anthropic.py) shares, in one import.

``state_of(request)`` is the app's ``ServerState``; everything else lives in the module
that does its job and is re-exported here:

- ``prepared.py``: the prompt model (``ChatPrompt``, ``Breakpoint``, ``TurnContext``,
  ``Prepared``).
- ``preparer.py``: preparation off the event loop (``Preparer``, ``preparer_of``): a
  ``ChatPrompt`` canonicalized, rendered, its breakpoints placed, its images expanded,
  its constraint compiled and its cached prefix predicted, in one worker thread.
- ``turns.py``: a turn's life: the context-window policy (``plan_max_tokens``),
  ``start``, ``after_reply`` / ``claim_chain`` (what the turn keeps in the cache),
  ``retention_of``.
- ``reply.py``: the reply pump (``reply_events``, ``collect_reply``, ``Finished``,
  ``LogprobDecoder``) and the SSE framing with keep-alive ticks (``sse_data``,
  ``sse_event``, ``with_keepalive``, ``KEEPALIVE``).

Imports go one way: prepared <- preparer <- turns, prepared <- reply; nothing below
imports this module.
"""

from __future__ import annotations

from fastapi import Request

from .prepared import Breakpoint, ChatPrompt, Prepared, TurnContext
from .preparer import Preparer, TemplateAbilities, preparer_of
from .reply import (
    KEEPALIVE,
    SSE_COMMENT,
    SSE_HEADERS,
    Finished,
    LogprobDecoder,
    ReplyEvent,
    Sleep,
    collect_reply,
    reply_events,
    reply_parser,
    sleep_of,
    sse_data,
    sse_event,
    with_keepalive,
)
from .runner import ServerState
from .turns import (
    KEY_PROTECT_S,
    RETENTIONS,
    after_reply,
    caching,
    claim_chain,
    context_window,
    max_output_tokens,
    plan_max_tokens,
    prerenderer_of,
    retention_of,
    start,
)

__all__ = [
    "KEEPALIVE", "KEY_PROTECT_S", "RETENTIONS", "SSE_COMMENT", "SSE_HEADERS", "Breakpoint",
    "ChatPrompt", "Finished", "LogprobDecoder", "Prepared", "Preparer", "ReplyEvent",
    "Sleep", "TemplateAbilities", "TurnContext", "after_reply", "caching", "claim_chain",
    "collect_reply", "context_window", "max_output_tokens", "plan_max_tokens",
    "preparer_of", "prerenderer_of", "reply_events", "reply_parser", "retention_of",
    "sleep_of", "sse_data", "sse_event", "start", "state_of", "with_keepalive",
]


def state_of(request: Request) -> ServerState:
    st: ServerState = request.app.state.pc
    return st
