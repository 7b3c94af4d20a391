"""Tool calls in the model's output -> structured calls (OpenAI ``tool_calls``,
Anthropic ``tool_use``).

Chat templates ask models to call tools in one of two common shapes:

- Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or
  several, possibly with text before, between or after them. A last block whose closing
  tag never came (generation stopped at it) counts when its JSON is complete.
- a bare JSON object ``{"name": ..., "arguments"|"parameters": {...}}`` (or a JSON list
  of them) as the whole reply (Llama 3.x style).

Only names of offered tools count. A block that is not valid JSON, names a tool that was
not offered, or whose arguments are not an object (or a JSON string of one) stays in the
text verbatim: a malformed call is the model's text, never a server error. Without
offered tools nothing is parsed.

``ToolCallStream`` is the incremental parser for streaming: ``feed(delta)`` returns the
text that is safe to send now (text before ``<tool_call>`` streams as normal; from the
tag on, or for a reply that starts like a JSON value, the rest is held back), and
``finish()`` returns the held-back text that turned out not to be a call plus the calls.
``parse_tool_calls`` runs the same machine over a whole reply, so a streamed reply and a
non-streamed one agree: the content is exactly the concatenation of the streamed text.
When calls are found, whitespace around them is dropped and text after them is joined
with a blank line.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"

_INVALID = object()


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class ParsedReply:
    text: str
    tool_calls: tuple[ToolCall, ...] = ()


def offered_tool_names(tools: Sequence[Mapping[str, Any]] | None) -> frozenset[str]:
    """Names of the tools in the OpenAI function format (what both APIs render with)."""
    names: set[str] = set()
    for tool in tools or ():
        fn = tool.get("function")
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return frozenset(names)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return _INVALID


def _call_from(obj: Any, names: Collection[str]) -> ToolCall | None:
    """A call from ``{"name", "arguments"|"parameters"}``; None when it is not one."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _loads(args) if args.strip() else {}
    if not isinstance(args, dict):
        return None
    return ToolCall(name=name, arguments=args)


def _bare_calls(text: str, names: Collection[str]) -> tuple[ToolCall, ...]:
    """Calls from a whole reply that is one JSON call object or a list of them."""
    obj = _loads(text.strip())
    items = obj if isinstance(obj, list) else [obj]
    calls = [_call_from(item, names) for item in items]
    if not calls or any(c is None for c in calls):
        return ()
    return tuple(c for c in calls if c is not None)


def _tagged_calls(held: str, names: Collection[str]) -> tuple[tuple[ToolCall, ...], list[str]]:
    """Parse ``<tool_call>`` blocks: (calls, the text pieces that are not calls)."""
    calls: list[ToolCall] = []
    pieces: list[str] = []
    pos = 0
    while True:
        start = held.find(OPEN_TAG, pos)
        if start < 0:
            pieces.append(held[pos:])
            break
        pieces.append(held[pos:start])
        body_start = start + len(OPEN_TAG)
        close = held.find(CLOSE_TAG, body_start)
        body_end = len(held) if close < 0 else close
        end = len(held) if close < 0 else close + len(CLOSE_TAG)
        call = _call_from(_loads(held[body_start:body_end].strip()), names)
        if call is None:
            pieces.append(held[start:end])
        else:
            calls.append(call)
        pos = end
    return tuple(calls), pieces


def _partial_tag_len(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of the open tag."""
    for k in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if text.endswith(OPEN_TAG[:k]):
            return k
    return 0


class ToolCallStream:
    """Incremental tool-call parser of one reply; see the module docstring."""

    def __init__(self, names: Collection[str]) -> None:
        self.names = frozenset(names)
        self.text = ""  # all text returned so far (feed + finish)
        self._pending = ""  # received, not yet returned (text mode)
        self._held = ""  # the possible call(s): from <tool_call> on, or the whole JSON reply
        self._gap = ""  # whitespace between the returned text and <tool_call>
        self._mode = "text"  # "text" | "bare" | "tagged"
        self._finished = False

    def _emit(self, out: str) -> str:
        self.text += out
        return out

    def feed(self, delta: str) -> str:
        """Take the next piece of the reply; return the text safe to send now."""
        if self._finished:
            raise RuntimeError("ToolCallStream.feed() after finish()")
        if not self.names:
            return self._emit(delta)
        if self._mode != "text":
            self._held += delta
            return ""
        pending = self._pending + delta
        if not self.text:
            head = pending.lstrip()
            if not head:
                self._pending = pending
                return ""
            if head[0] in "{[":
                self._mode, self._held, self._pending = "bare", pending, ""
                return ""
        start = pending.find(OPEN_TAG)
        if start >= 0:
            before = pending[:start]
            out = before.rstrip()
            self._gap = before[len(out):]
            self._mode, self._held, self._pending = "tagged", pending[start:], ""
            return self._emit(out)
        safe = pending[: len(pending) - _partial_tag_len(pending)]
        out = safe.rstrip()  # trailing whitespace waits: it is dropped before a call
        self._pending = pending[len(out):]
        return self._emit(out)

    def finish(self) -> tuple[str, tuple[ToolCall, ...]]:
        """End of the reply: (the remaining text to send, the tool calls found)."""
        if self._finished:
            raise RuntimeError("ToolCallStream.finish() called twice")
        self._finished = True
        if self._mode == "text":
            tail, self._pending = self._pending, ""
            return self._emit(tail), ()
        if self._mode == "bare":
            calls = _bare_calls(self._held, self.names)
            return ("", calls) if calls else (self._emit(self._held), ())
        calls, pieces = _tagged_calls(self._held, self.names)
        if not calls:
            return self._emit(self._gap + self._held), ()
        rest = "\n\n".join(p.strip() for p in pieces if p.strip())
        if rest and self.text:
            rest = "\n\n" + rest
        return self._emit(rest), calls


def parse_tool_calls(text: str, names: Collection[str]) -> ParsedReply:
    """Tool calls of a whole reply (the same result as streaming it through
    ``ToolCallStream``)."""
    stream = ToolCallStream(names)
    head = stream.feed(text)
    tail, calls = stream.finish()
    return ParsedReply(text=head + tail, tool_calls=calls)
