"""What a request is before and after preparation (``preparer.py`` does the work):
``ChatPrompt`` (parsed, before the template), ``Breakpoint`` (Anthropic ``cache_control``),
``TurnContext`` (who asks, for the previous-turn comparison) and ``Prepared`` (what the
engine, the reply parser and the diagnostics get)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...engine.api import Constraint, ImageInput
from ...engine.formats.chat_format import ChatFormat, ToolCallFormat
from ..api.auth import Scope
from ..ops.diagnostics import NO_PREVIOUS, Divergence, Fingerprint, TurnKey
from .images import ImageCollector
from .structured import OutputSpec


@dataclass(frozen=True)
class ChatPrompt:
    """A parsed chat request, before the template: what every API turns its body into."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    # Anthropic ``thinking`` / Responses ``reasoning``; None: the template's default
    thinking: bool | None = None
    # the images of a vision-language prompt (decoded in the worker thread), else None
    images: ImageCollector | None = None
    # what the reply must be (structured.py: a JSON schema, a forced tool call)
    structure: OutputSpec | None = None
    # the body as sent, never rendered (miss explanations name its parts)
    source: Any = field(default=None, compare=False, repr=False)
    # the client's cache breakpoints (Anthropic cache_control)
    breakpoints: tuple[Breakpoint, ...] = ()
    # prompt_cache_retention: ``in_memory`` | ``24h`` (also the lower tiers at once); None
    retention: str | None = None


@dataclass(frozen=True)
class Breakpoint:
    """Keep the prefix up to the end of the leading system prompt (``message=None``) or of
    template message ``message``, for ``ttl_s`` seconds."""

    message: int | None
    ttl_s: float


@dataclass(frozen=True)
class TurnContext:
    """Who asks, for the comparison with the previous turn (``diagnostics.py``)."""

    key: TurnKey | None = None
    # Anthropic ``diagnostics.previous_message_id`` (``named_previous``: sent, maybe null)
    previous_message_id: str | None = None
    named_previous: bool = False
    # the requester's tenant: a message id names a turn of this tenant only
    tenant: str | None = None

    @classmethod
    def of(cls, scope: Scope, previous_message_id: str | None = None,
           named_previous: bool = False) -> TurnContext:
        key = TurnKey(scope.tenant, scope.session_id, scope.agent_id) \
            if scope.session_id else None
        return cls(key, previous_message_id, named_previous, scope.tenant)


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
    # the lookup found every token of the prompt stored: the request writes nothing
    predicted_whole: bool = False
    # decoded images with their placeholder spans (``tokens`` holds the placeholders)
    images: tuple[ImageInput, ...] = field(default=())
    # the tool-call format the model was asked for (its own, or the Hermes fallback)
    tool_format: ToolCallFormat | None = None
    # the tools the request offers, as sent (the reply parser reads calls with them)
    tools: list[dict[str, Any]] | None = None
    # constrained decoding for the request's ``structure`` (compiled, checked)
    constraint: Constraint | None = None
    # tool_choice required / a named tool: calls only, never text
    forced_call: bool = False
    # the template messages as rendered (after system placement and the tools fallback)
    messages: list[dict[str, Any]] = field(default_factory=list)
    # before the tools fallback, with the template variables (``Preparer.tools_span``)
    plain_messages: list[dict[str, Any]] = field(default_factory=list)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    fingerprint: Fingerprint | None = None
    # this request against the previous turn of its session (diagnostics.py)
    divergence: Divergence = NO_PREVIOUS
    # the cache's cause of a short predicted match (with ``predicted_cached``)
    predicted_cause: str | None = None
    # the breakpoints as token positions: ((end, ttl seconds), ...) by position
    breakpoints: tuple[tuple[int, float], ...] = ()
