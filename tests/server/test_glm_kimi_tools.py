"""GLM-4.7 (``<arg_key>`` / ``<arg_value>``) and Kimi-K2 (``<|tool_calls_section_begin|>``)
tool calls, parsed by mlx-lm's parsers, through chat, Messages and Responses, streamed
and whole: a 200-line file as a GLM argument, nested JSON as a Kimi argument."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sse_checks
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import assert_streamed_equals_whole
from test_server_structured import _app

from promptcache.engine.formats.chat_format import ChatFormat, tool_call_format

WRITE = {"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"},
                                     "content": {"type": "string"},
                                     "options": {"type": "object"}}}}}
OAI_TOOLS = [WRITE]
ANT_TOOLS = [{"name": "write_file", "input_schema": WRITE["function"]["parameters"]}]
RESP_TOOLS = [{"type": "function", **WRITE["function"]}]
FILE = "\n".join(f"x{i} = f({i})" for i in range(200)) + "\n"  # 200 lines
OPTIONS = {"mode": "w", "backup": {"keep": 3, "dirs": ["a", "b"]}, "force": True}

GLM = ("Writing it.<tool_call>write_file<arg_key>path</arg_key><arg_value>src/app.py"
       f"</arg_value><arg_key>content</arg_key><arg_value>{FILE}</arg_value>"
       "</tool_call>")
KIMI = ("Writing it.<|tool_calls_section_begin|><|tool_call_begin|>functions.write_file:0"
        "<|tool_call_argument_begin|>"
        + json.dumps({"path": "src/app.py", "options": OPTIONS})
        + "<|tool_call_end|><|tool_calls_section_end|>")
WANT = {"glm47": ("write_file", {"path": "src/app.py", "content": FILE}),
        "kimi_k2": ("write_file", {"path": "src/app.py", "options": OPTIONS})}
REPLIES = {"glm47": GLM, "kimi_k2": KIMI}


def engine(fmt: str) -> Any:
    from fake_engine import FakeEngine

    eng = FakeEngine(reply=REPLIES[fmt], context_length=65_536)
    eng.chat_format = ChatFormat(tool_format=tool_call_format(fmt))
    return eng


@pytest.mark.parametrize("fmt", sorted(REPLIES))
@pytest.mark.parametrize("stream", [False, True])
def test_every_api(fmt: str, stream: bool) -> None:
    sse_checks.assert_one_call_in_every_api(
        _app(engine(fmt)), {"chat": OAI_TOOLS, "messages": ANT_TOOLS,
                            "responses": RESP_TOOLS}, WANT[fmt], "Writing it.", stream,
        max_tokens=4000)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(REPLIES)), st.lists(st.integers(0, 9000), max_size=8))
def test_streamed_and_whole_agree(fmt: str, cuts: list[int]) -> None:
    assert_streamed_equals_whole(REPLIES[fmt], cuts, {"write_file"}, tool_call_format(fmt),
                                 OAI_TOOLS)
