"""DeepSeek V3 / V3.1 tool calls (our parser: mlx-lm has none), recognised from the
chat template; streamed and whole through chat, Messages and Responses; a forced call
is a grammar in the same format that the parser reads back."""

from __future__ import annotations

from typing import Any

import pytest
import sse_checks
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import assert_streamed_equals_whole
from test_server_structured import ANT_TOOLS, HI, OAI_TOOLS, RESP_TOOLS, WANT, _app

from promptcache.engine.formats.chat_format import DEEPSEEK, ChatFormat, ToolCall, chat_format_of
from promptcache.engine.formats.tool_formats import parse_deepseek
from promptcache.server.replies.toolcalls import parse_tool_calls

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
V31 = f'Checking.{B}{CB}get_weather{SEP}{{"city": "Paris", "days": 3}}{CE}{E}'
V3 = (f"Checking.{B}{CB}function{SEP}get_weather\n```json\n"
      f'{{"city": "Paris", "days": 3}}\n```{CE}{E}')
TWO = f'{B}{CB}get_weather{SEP}{{"city": "Paris", "days": 3}}{CE}{CB}list_files{SEP}{{}}{CE}{E}'


def test_both_versions_parse() -> None:
    for body in (V31, V3):
        inner = body[body.index(B) + len(B):body.index(E)]
        assert parse_deepseek(inner) == [{"name": "get_weather",
                                          "arguments": {"city": "Paris", "days": 3}}]
    assert [c["name"] for c in parse_deepseek(TWO[len(B):-len(E)])] == ["get_weather",
                                                                        "list_files"]
    for bad in ("", "text", f"{CB}get_weather{SEP}{{", f"{CB}get_weather{CE}",
                f"{CB}get_weather{SEP}[1]{CE}"):
        with pytest.raises(ValueError):
            parse_deepseek(bad)


def test_recognised_from_the_template() -> None:
    class Tok:
        chat_template = "{% if tools %}" + B + "{% endif %}"

    assert chat_format_of(Tok()).tool_format is DEEPSEEK


def engine(reply: str) -> Any:
    from fake_engine import FakeEngine

    eng = FakeEngine(reply=reply)
    eng.chat_format = ChatFormat(tool_format=DEEPSEEK)
    return eng


@pytest.mark.parametrize("reply", [V31, V3])
@pytest.mark.parametrize("stream", [False, True])
def test_every_api(reply: str, stream: bool) -> None:
    sse_checks.assert_one_call_in_every_api(
        _app(engine(reply)), {"chat": OAI_TOOLS, "messages": ANT_TOOLS,
                              "responses": RESP_TOOLS}, WANT, "Checking.", stream)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([V31, V3, TWO, f"{B}{CB}rm_rf{SEP}{{}}{CE}{E}", "plain " + B[:5]]),
       st.lists(st.integers(0, 200), max_size=8))
def test_streamed_and_whole_agree(reply: str, cuts: list[int]) -> None:
    assert_streamed_equals_whole(reply, cuts, {"get_weather", "list_files"}, DEEPSEEK,
                                 OAI_TOOLS)


def test_a_forced_call_is_a_grammar_in_the_same_format() -> None:
    eng = engine(V31)
    client = _app(eng)
    client.post("/v1/chat/completions", json={"messages": HI, "tools": OAI_TOOLS,
                                              "tool_choice": "required"})
    spec = eng.submitted[-1].constraint.spec
    # the markers spelled out (this fake tokenizer has no added tokens for them)
    assert f'"{CB}" "get_weather" "{SEP}" args_0 "{CE}"' in spec
    assert f'calls: "{B}" call call* "{E}"' in spec
    two = parse_tool_calls(TWO, {"get_weather", "list_files"}, DEEPSEEK, OAI_TOOLS)
    assert two.tool_calls == (ToolCall(*WANT), ToolCall("list_files", {}))
