"""gpt-oss's harmony format: channels -> reasoning (``analysis``), text (``final``) and
tool calls (``commentary to=functions.NAME``). Not ``openai-harmony``: its encoding fetches
a vocabulary at first use, and the markers are plain text in the reply."""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from ...engine.formats.chat_format import ToolCall
from .reasoning import Piece, ReplyParser, _partial_suffix

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
_ENDS = (END, CALL, RETURN)
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
# a header never gets longer than this (role, channel, recipient, constraint)
_MAX_HEADER = 512
_HEADER_STARTS = (START, CHANNEL, "assistant", " to=", "to=")


def _partial(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    return max(_partial_suffix(text, m) for m in markers)


class HarmonyParser(ReplyParser):
    def __init__(self, *, tool_names: Collection[str] = (),
                 tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        super().__init__()
        self.names = frozenset(tool_names)
        self.offered = tools
        self._buf = ""
        self._header: str | None = ""  # None: inside a message body
        self._kind = "text"  # "reasoning" | "text" | "call" (of the current body)
        self._recipient: str | None = None
        self._call_body = ""
        self._calls: list[ToolCall] = []

    @property
    def in_reasoning(self) -> bool:
        return self._header is None and self._kind == "reasoning"

    def _emit(self, kind: str, text: str) -> list[Piece]:
        if not text:
            return []
        if kind == "call":
            self._call_body += text
            return []
        if kind == "reasoning":
            self.reasoning += text
            return [Piece("reasoning", text)]
        self.text += text
        return [Piece("text", text)]

    def _open(self, header: str) -> None:
        """A message starts: its kind from the header."""
        m = _CHANNEL.search(header)
        channel = m.group(1) if m else "final"
        r = _RECIPIENT.search(header)
        self._recipient = r.group(1) if r else None
        if channel == "analysis":
            self._kind = "reasoning"
        elif self._recipient is not None and self._recipient.startswith("functions."):
            self._kind = "call"
        else:
            self._kind = "text"
        self._call_body = ""
        self._header = None

    def _close(self) -> list[Piece]:
        """The current message ended: a call body becomes a call or text."""
        out: list[Piece] = []
        if self._kind == "call":
            name = (self._recipient or "")[len("functions."):]
            call = self._as_call(name, self._call_body)
            if call is not None:
                self._calls.append(call)
            else:
                out += self._emit("text", self._call_body)
            self._call_body = ""
        self._header = ""
        self._kind = "text"
        return out

    def _as_call(self, name: str, body: str) -> ToolCall | None:
        if name not in self.names:
            return None
        try:
            args = json.loads(body) if body.strip() else {}
        except (ValueError, RecursionError):
            return None
        return ToolCall(name, args) if isinstance(args, dict) else None

    def feed(self, delta: str) -> list[Piece]:
        self._buf += delta
        out: list[Piece] = []
        while self._buf:
            if self._header is not None:  # reading a header
                at = self._buf.find(MESSAGE)
                if at >= 0:
                    self._open(self._buf[:at])
                    self._buf = self._buf[at + len(MESSAGE):]
                    continue
                head = self._buf.lstrip()
                if head and not self._could_be_header(head):
                    # not harmony (or the model left the format): plain text from here
                    self._header, self._kind = None, "text"
                    continue
                if len(self._buf) > _MAX_HEADER:
                    self._header, self._kind = None, "text"
                    continue
                return out
            ends = [(i, m) for m in _ENDS if (i := self._buf.find(m)) >= 0]
            starts = self._buf.find(START)
            if starts >= 0:
                ends.append((starts, ""))  # a new message without an end marker
            if ends:
                at, marker = min(ends)
                out += self._emit(self._kind, self._buf[:at])
                out += self._close()
                self._buf = self._buf[at + len(marker):]
                continue
            keep = _partial(self._buf, (*_ENDS, START))
            ready = self._buf[:len(self._buf) - keep]
            self._buf = self._buf[len(self._buf) - keep:]
            out += self._emit(self._kind, ready)
            return out
        return out

    def _could_be_header(self, text: str) -> bool:
        for start in _HEADER_STARTS:
            s = start.lstrip()
            if text.startswith(s) or s.startswith(text):
                return True
        return False

    def finish(self) -> tuple[list[Piece], tuple[ToolCall, ...]]:
        rest, self._buf = self._buf, ""
        out: list[Piece] = []
        if self._header is not None:
            # a header that never reached <|message|>: nothing to show unless it was text
            if rest.strip() and not self._could_be_header(rest.lstrip()):
                out += self._emit("text", rest)
        else:
            out += self._emit(self._kind, rest)
            out += self._close()
        return out, tuple(self._calls)
