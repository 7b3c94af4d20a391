"""Tool calls in the model's output -> structured calls, in every format mlx-lm parses
(unknown templates: ``HERMES``, or a bare JSON call); only offered tools count, what does not
parse stays text. Streamed (``ToolCallStream``) and whole replies share one machine."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...engine.formats.chat_format import HERMES, ToolCall, ToolCallFormat

log = logging.getLogger(__name__)

__all__ = ["HERMES", "ParsedReply", "ToolCall", "ToolCallStream", "offered_tool_names",
           "parse_tool_calls"]

Tools = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class ParsedReply:
    text: str
    tool_calls: tuple[ToolCall, ...] = ()


def offered_tool_names(tools: Tools | None) -> frozenset[str]:
    """Names of the tools in the OpenAI function format (what both APIs render with)."""
    names: set[str] = set()
    for tool in tools or ():
        fn = tool.get("function")
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return frozenset(names)


def _calls(fmt: ToolCallFormat, body: str, names: Collection[str], tools: Tools | None
           ) -> tuple[ToolCall, ...] | None:
    """The calls of one block, or None when it is not a call of offered tools."""
    try:
        calls = fmt.parse(body, tools)
    except ValueError:
        return None
    return calls if all(c.name in names for c in calls) else None


def _blocks(held: str, fmt: ToolCallFormat, names: Collection[str], tools: Tools | None
            ) -> tuple[list[ToolCall], list[str]]:
    """Split ``held`` at the call markers: (calls, the text pieces that are not calls)."""
    calls: list[ToolCall] = []
    pieces: list[str] = []
    pos = 0
    while True:
        start = held.find(fmt.start, pos)
        if start < 0:
            pieces.append(held[pos:])
            break
        pieces.append(held[pos:start])
        body_start = start + len(fmt.start)
        if fmt.end:
            close = held.find(fmt.end, body_start)
            body_end = len(held) if close < 0 else close
            end = len(held) if close < 0 else close + len(fmt.end)
        else:  # no end marker: up to the next call or the end of the reply
            nxt = held.find(fmt.start, body_start)
            body_end = end = len(held) if nxt < 0 else nxt
        found = _calls(fmt, held[body_start:body_end], names, tools)
        if found is None:
            pieces.append(held[start:end])
        else:
            calls.extend(found)
        pos = end
    return calls, pieces


def _partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolCallStream:
    def __init__(self, names: Collection[str], fmt: ToolCallFormat = HERMES,
                 tools: Tools | None = None, *, calls_only: bool = False) -> None:
        self.names = frozenset(names)
        self.fmt = fmt
        self.tools = list(tools) if tools else None
        self.calls_only = calls_only and bool(self.names)
        self.text = ""  # all text returned so far (feed + finish)
        self._pending = ""  # received, not yet returned (text mode)
        self._held = ""  # the possible call(s): from the start marker on, or the JSON reply
        self._gap = ""  # whitespace between the returned text and the start marker
        # "text" | "bare" | "tagged"; a forced reply is held whole ("tagged") from the start
        self._mode = "tagged" if self.calls_only else "text"
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
        if not self.text and self.fmt.bare_json:
            head = pending.lstrip()
            if not head:
                self._pending = pending
                return ""
            if head[0] in "{[":
                self._mode, self._held, self._pending = "bare", pending, ""
                return ""
        start = pending.find(self.fmt.start)
        if start >= 0:
            before = pending[:start]
            out = before.rstrip()
            self._gap = before[len(out):]
            self._mode, self._held, self._pending = "tagged", pending[start:], ""
            return self._emit(out)
        safe = pending[: len(pending) - _partial_marker_len(pending, self.fmt.start)]
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
            calls = _calls(self.fmt, self._held.strip(), self.names, self.tools)
            return ("", calls) if calls else (self._emit(self._held), ())
        found, pieces = _blocks(self._held, self.fmt, self.names, self.tools)
        if self.calls_only:
            dropped = "".join(pieces).strip()
            if dropped:
                log.info("a forced tool-call reply ended with %d characters that are not a "
                         "complete call (max_tokens?): dropped", len(dropped))
            return "", tuple(found)
        if not found:
            return self._emit(self._gap + self._held), ()
        rest = "\n\n".join(p.strip() for p in pieces if p.strip())
        if rest and self.text:
            rest = "\n\n" + rest
        return self._emit(rest), tuple(found)


def parse_tool_calls(text: str, names: Collection[str], fmt: ToolCallFormat = HERMES,
                     tools: Tools | None = None, *, calls_only: bool = False) -> ParsedReply:
    """Tool calls of a whole reply (as streaming it through ``ToolCallStream`` gives)."""
    stream = ToolCallStream(names, fmt, tools, calls_only=calls_only)
    head = stream.feed(text)
    tail, calls = stream.finish()
    return ParsedReply(text=head + tail, tool_calls=calls)
