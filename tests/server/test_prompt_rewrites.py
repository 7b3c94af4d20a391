"""Pure pieces of the request path: system-message placement, the tools fallback, the
reasoning splitter, the keep-alive interleaver."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from promptcache.server.prompts.prompt import (
    SYSTEM_NOTE_FORMAT,
    place_system_messages,
    tools_into_system,
    tools_text,
)
from promptcache.server.replies.reasoning import Piece, ReasoningSplitter, ReplyParser, parse_reply
from promptcache.server.replies.reply import KEEPALIVE, with_keepalive


def m(role: str, content: str, **kw: Any) -> dict[str, Any]:
    return {"role": role, "content": content, **kw}


def note(text: str) -> str:
    return SYSTEM_NOTE_FORMAT.format(text=text)


def test_system_messages_stay_where_they_stand() -> None:
    convo = [m("system", "s0"), m("system", "s1"), m("user", "u1"), m("system", "agents"),
             m("assistant", "a1"), m("system", "late"), m("user", "u2")]
    # a template with system turns anywhere: untouched, leading ones joined
    assert place_system_messages(convo, True) == [
        m("system", "s0\n\ns1"), m("user", "u1"), m("system", "agents"), m("assistant", "a1"),
        m("system", "late"), m("user", "u2")]
    # otherwise: a note in the neighbouring user turn, at the same position
    assert place_system_messages(convo, False) == [
        m("system", "s0\n\ns1"), m("user", "u1\n\n" + note("agents")), m("assistant", "a1"),
        m("user", note("late") + "\n\nu2")]


def test_system_note_placement_corner_cases() -> None:
    # Claude Code's first turn: the agent list right after the first user message, last
    assert place_system_messages([m("user", "hi"), m("system", "agents")], False) == \
        [m("user", "hi\n\n" + note("agents"))]
    # between two assistant turns: a user turn of its own
    assert place_system_messages([m("user", "u"), m("assistant", "a"), m("system", "x"),
                                  m("assistant", "b")], False) == \
        [m("user", "u"), m("assistant", "a"), m("user", note("x")), m("assistant", "b")]
    # several in a row before a user turn: all prepended, in order
    assert place_system_messages([m("user", "u"), m("assistant", "a"), m("system", "x"),
                                  m("system", "y"), m("user", "v")], False) == \
        [m("user", "u"), m("assistant", "a"), m("user", note("x") + "\n\n" + note("y") + "\n\nv")]


@given(st.lists(st.sampled_from(["system", "user", "assistant"]), min_size=1, max_size=8))
def test_system_placement_keeps_order_and_never_hoists(roles: list[str]) -> None:
    convo = [m(r, f"{r}{i}") for i, r in enumerate(roles)]
    out = place_system_messages(convo, False)
    text = "\x00".join(x["content"] for x in out)
    # every message's text is there, in the original order
    pos = [text.index(f"{r}{i}") for i, r in enumerate(roles)]
    assert pos == sorted(pos)
    # only leading system messages stay system turns
    first_other = next((i for i, r in enumerate(roles) if r != "system"), len(roles))
    assert sum(x["role"] == "system" for x in out) == (1 if first_other > 0 else 0)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "w",
                                           "parameters": {"type": "object"}}}]


def test_tools_fallback_goes_into_the_system_turn() -> None:
    convo = [m("system", "sys"), m("user", "weather?"),
             m("assistant", "Checking.", tool_calls=[{"id": "c1", "type": "function", "function": {
                 "name": "get_weather", "arguments": {"city": "Paris"}}}]),
             m("tool", "sunny", tool_call_id="c1"), m("tool", "warm", tool_call_id="c2"),
             m("user", "thanks")]
    out = tools_into_system(convo, TOOLS)
    block = tools_text(TOOLS)
    assert json.dumps(TOOLS[0]) in block and "<tool_call>" in block
    assert out == [
        m("system", "sys\n\n" + block), m("user", "weather?"),
        m("assistant", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": '
                       '{"city": "Paris"}}\n</tool_call>'),
        m("user", "<tool_response>\nsunny\n</tool_response>\n"
                  "<tool_response>\nwarm\n</tool_response>"),
        m("user", "thanks")]
    assert tools_into_system([m("user", "hi")], TOOLS) == [m("system", block), m("user", "hi")]


def test_reasoning_splitter_holds_partial_markers() -> None:
    s = ReasoningSplitter("<think>", "</think>")
    got = []
    for delta in ["<th", "ink>\nLet", " me</th", "ink>\n\nThe", " answer<", "/b>"]:
        got += s.feed(delta)
    got += s.finish()
    assert got == [Piece("reasoning", "Let"), Piece("reasoning", " me"),
                   Piece("text", "The"), Piece("text", " answer"), Piece("text", "</b>")]
    # the prompt opened the block: the reply starts inside it
    s = ReasoningSplitter("<think>", "</think>", in_reasoning=True)
    assert s.feed("a</think>b") == [Piece("reasoning", "a"), Piece("text", "b")]
    # no markers: everything is text
    assert ReasoningSplitter(None, None).feed("<think>x") == [Piece("text", "<think>x")]


@given(st.text(alphabet="ab<>/thinkx\n", max_size=40), st.data())
def test_streamed_and_whole_replies_agree(reply: str, data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(reply)), max_size=6)))
    parser = ReplyParser("<think>", "</think>", tool_names={"f"})
    pieces: list[Piece] = []
    prev = 0
    for c in [*cuts, len(reply)]:
        pieces += parser.feed(reply[prev:c])
        prev = c
    rest, calls = parser.finish()
    pieces += rest
    whole = parse_reply(reply, ReplyParser("<think>", "</think>", tool_names={"f"}))
    assert "".join(p.text for p in pieces if p.kind == "reasoning") == whole.reasoning
    assert "".join(p.text for p in pieces if p.kind == "text") == whole.text
    assert calls == whole.tool_calls


class FakeClock:
    """Discrete time: ``sleep`` advances the clock, unless an event is due first (then
    it makes that event happen and never returns: the event wins the race)."""

    def __init__(self, event_at: float) -> None:
        self.now = 0.0
        self.event_at = event_at
        self.ticks: list[float] = []
        self._due: asyncio.Event | None = None

    @property
    def due(self) -> asyncio.Event:
        if self._due is None:
            self._due = asyncio.Event()
        return self._due

    async def sleep(self, seconds: float) -> None:
        target = self.now + seconds
        if self.event_at <= target:
            self.now = self.event_at
            self.due.set()
            await asyncio.Event().wait()  # cancelled by the caller
        self.now = target
        self.ticks.append(self.now)

    async def wait_event(self) -> None:
        await self.due.wait()


def test_keepalive_ticks_at_the_interval_until_the_event() -> None:
    clock = FakeClock(event_at=605.0)

    async def source() -> AsyncIterator[str]:
        await clock.wait_event()  # a 10-minute prefill
        yield "first token"
        yield "second"

    async def run() -> list[Any]:
        return [ev async for ev in with_keepalive(source(), 10.0, clock.sleep)]

    out = asyncio.run(run())
    assert out == [KEEPALIVE] * 60 + ["first token", "second"]
    assert clock.ticks == [10.0 * i for i in range(1, 61)]
