"""A reply as the APIs return it: reasoning, answer text and tool calls.
``ReasoningSplitter`` cuts the text at the chat format's reasoning markers (a marker split
across deltas is held back); ``ReplyParser`` runs the answer through the tool-call parser.
Streamed and whole replies (``parse_reply``) go through the same machine, so they agree."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ...engine.formats.chat_format import HERMES, ToolCall, ToolCallFormat
from .toolcalls import ToolCallStream

PieceKind = Literal["reasoning", "text"]


@dataclass(frozen=True)
class Piece:
    kind: PieceKind
    text: str


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningSplitter:
    def __init__(self, start: str | None, end: str | None, *, in_reasoning: bool = False
                 ) -> None:
        self.start = start if start and end else None
        self.end = end if start and end else None
        self.in_reasoning = in_reasoning and self.start is not None
        self._buf = ""
        self._strip = self.in_reasoning  # drop newlines right after a marker

    def _piece(self, kind: PieceKind, text: str) -> list[Piece]:
        if self._strip:
            text = text.lstrip("\n")
            if not text:
                return []
            self._strip = False
        return [Piece(kind, text)] if text else []

    def feed(self, delta: str) -> list[Piece]:
        if self.start is None or self.end is None:
            return [Piece("text", delta)] if delta else []
        self._buf += delta
        out: list[Piece] = []
        while True:
            marker = self.end if self.in_reasoning else self.start
            kind: PieceKind = "reasoning" if self.in_reasoning else "text"
            at = self._buf.find(marker)
            if at < 0:
                keep = _partial_suffix(self._buf, marker)
                ready, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                out += self._piece(kind, ready)
                return out
            out += self._piece(kind, self._buf[:at])
            self._buf = self._buf[at + len(marker):]
            self.in_reasoning = not self.in_reasoning
            self._strip = True

    def finish(self) -> list[Piece]:
        """The held-back rest (a partial marker that never completed is text)."""
        rest, self._buf = self._buf, ""
        return self._piece("reasoning" if self.in_reasoning else "text", rest)


class ReplyParser:
    def __init__(self, think_start: str | None = None, think_end: str | None = None, *,
                 in_reasoning: bool = False, tool_names: Collection[str] = (),
                 tool_format: ToolCallFormat = HERMES,
                 tools: Sequence[Mapping[str, Any]] | None = None,
                 calls_only: bool = False) -> None:
        self.splitter = ReasoningSplitter(think_start, think_end, in_reasoning=in_reasoning)
        self.tools = ToolCallStream(tool_names, tool_format, tools, calls_only=calls_only) \
            if tool_names else None
        self.reasoning = ""  # all reasoning returned so far
        self.text = ""  # all answer text returned so far

    @property
    def in_reasoning(self) -> bool:
        """The reply is inside its reasoning now (its tokens count as reasoning)."""
        return self.splitter.in_reasoning

    def _route(self, pieces: list[Piece]) -> list[Piece]:
        out: list[Piece] = []
        for p in pieces:
            if p.kind == "reasoning":
                self.reasoning += p.text
                out.append(p)
                continue
            text = self.tools.feed(p.text) if self.tools is not None else p.text
            if text:
                self.text += text
                out.append(Piece("text", text))
        return out

    def feed(self, delta: str) -> list[Piece]:
        """The pieces safe to send now (adjacent pieces of one kind are not merged)."""
        return self._route(self.splitter.feed(delta))

    def finish(self) -> tuple[list[Piece], tuple[ToolCall, ...]]:
        """End of the reply: the remaining pieces and the tool calls found."""
        out = self._route(self.splitter.finish())
        if self.tools is None:
            return out, ()
        rest, calls = self.tools.finish()
        if rest:
            self.text += rest
            out.append(Piece("text", rest))
        return out, calls


@dataclass(frozen=True)
class Reply:
    reasoning: str
    text: str
    tool_calls: tuple[ToolCall, ...]


def parse_reply(text: str, parser: ReplyParser) -> Reply:
    """A whole reply through ``parser`` (a fresh one): the same result as streaming it."""
    parser.feed(text)
    _, calls = parser.finish()
    return Reply(parser.reasoning, parser.text, calls)
