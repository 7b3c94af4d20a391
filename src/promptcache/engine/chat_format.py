"""What the server needs to know about a model's chat format, as plain data.

``chat_format_of(tokenizer)`` reads it from mlx-lm's ``TokenizerWrapper`` (public
properties only) and the chat template's source:

- ``think_start`` / ``think_end``: the markers around the reasoning the model emits
  (``<think>`` / ``</think>`` and the other pairs mlx-lm recognises); ``None`` when the
  tokenizer has none.
- ``thinking_kwarg``: the template variable that switches reasoning on or off
  (``enable_thinking``, or ``thinking`` for templates that read that name), when the
  template actually reads it; ``None`` otherwise (passing the switch would change
  nothing).

The server uses it to drive Anthropic ``thinking`` / Responses ``reasoning`` and to
split the model's reasoning from its answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_ENABLE_THINKING = re.compile(r"\benable_thinking\b")
# templates (e.g. DeepSeek V3.1) that read a bare ``thinking`` variable
_BARE_THINKING = re.compile(r"\bthinking\s+is\s+(?:not\s+)?defined\b|\bif\s+(?:not\s+)?thinking\b")


@dataclass(frozen=True)
class ChatFormat:
    think_start: str | None = None
    think_end: str | None = None
    thinking_kwarg: str | None = None

    @property
    def has_thinking(self) -> bool:
        """The model marks its reasoning (so it can be split from the answer)."""
        return bool(self.think_start) and bool(self.think_end)

    def thinking_kwargs(self, enabled: bool | None) -> dict[str, bool]:
        """Template variables for a request's thinking switch (empty: leave the
        template's default, or the template has no switch)."""
        if enabled is None or self.thinking_kwarg is None:
            return {}
        return {self.thinking_kwarg: bool(enabled)}


def _template_source(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        return template
    if isinstance(template, dict):  # named templates: {"default": ..., "tool_use": ...}
        return "\n".join(str(v) for v in template.values())
    return ""


def chat_format_of(tokenizer: Any) -> ChatFormat:
    """The chat format of an mlx-lm ``TokenizerWrapper`` (or anything with the same
    public properties); unknown attributes read as "none"."""
    start = getattr(tokenizer, "think_start", None)
    end = getattr(tokenizer, "think_end", None)
    source = _template_source(tokenizer)
    kwarg: str | None = None
    if _ENABLE_THINKING.search(source):
        kwarg = "enable_thinking"
    elif _BARE_THINKING.search(source):
        kwarg = "thinking"
    return ChatFormat(
        think_start=start if isinstance(start, str) and start else None,
        think_end=end if isinstance(end, str) and end else None,
        thinking_kwarg=kwarg,
    )
