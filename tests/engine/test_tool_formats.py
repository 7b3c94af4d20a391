"""Our Qwen3-Coder XML parser (engine/formats/tool_formats.py) on what agents write: long
multi-line files, code that contains the format's own closing tags, nested JSON,
nullable and union types, several calls in one block."""

from __future__ import annotations

import json

import pytest

from promptcache.engine.formats.chat_format import ToolCall, tool_call_format
from promptcache.engine.formats.tool_formats import parse_qwen3_coder

WRITE = {"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"},
        "mode": {"type": ["string", "null"]}, "lines": {"type": "integer"},
        "ratio": {"type": "number"}, "force": {"type": "boolean"},
        "options": {"type": "object"}, "tags": {"type": "array"},
        "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "either": {"type": ["integer", "string"]}}}}}
TOOLS = [WRITE]


def xml(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"\n<function={name}>\n{body}</function>\n"


def big_file(lines: int = 200) -> str:
    out = []
    for i in range(lines):
        if i % 50 == 7:
            out.append('    s = "</parameter> and </function> inside a string"')
        elif i % 50 == 9:
            out.append("    return {'a': [1, 2, {'b': None}]}  # not JSON, stays text")
        else:
            out.append(f"    x_{i} = compute({i}, 'value {i}')\n")
    return "def main():\n" + "\n".join(out) + "\n\nnull"


def test_a_200_line_file_with_the_formats_own_tags_is_one_intact_argument() -> None:
    content = big_file()
    assert content.count("\n") > 200
    calls = parse_qwen3_coder(xml("write_file", path="src/app.py", content=content), TOOLS)
    assert calls == [{"name": "write_file",
                      "arguments": {"path": "src/app.py", "content": content}}]


def test_values_follow_their_schema_types() -> None:
    nested = {"indent": 4, "rules": [{"name": "x", "on": True, "v": None}]}
    calls = parse_qwen3_coder(xml(
        "write_file", path="null", mode="null", lines="12", ratio="0.5", force="true",
        options=json.dumps(nested, indent=2), tags='["a", "b"]', limit="null",
        either="7"), TOOLS)
    assert calls[0]["arguments"] == {
        "path": "null",  # a string stays a string, even "null"
        "mode": None, "lines": 12, "ratio": 0.5, "force": True, "options": nested,
        "tags": ["a", "b"], "limit": None, "either": 7}


def test_a_value_that_does_not_convert_stays_the_models_text() -> None:
    calls = parse_qwen3_coder(xml("write_file", lines="twelve", options="{[]: 1}",
                                  tags="not a list", either=" 7"), TOOLS)
    assert calls[0]["arguments"] == {"lines": "twelve", "options": "{[]: 1}",
                                     "tags": "not a list", "either": " 7"}


def test_unknown_tools_and_parameters_keep_text_or_json() -> None:
    calls = parse_qwen3_coder(xml("other", a="plain text", b='{"k": [1, true]}'), TOOLS)
    assert calls[0]["arguments"] == {"a": "plain text", "b": {"k": [1, True]}}


def test_several_functions_in_one_block_are_several_calls() -> None:
    body = xml("write_file", path="a.py") + xml("write_file", path="b.py")
    assert [c["arguments"]["path"] for c in parse_qwen3_coder(body, TOOLS)] == ["a.py", "b.py"]


@pytest.mark.parametrize("body", [
    "", "just text", "\n<function=write_file>\n<parameter=path>\na.py\n",
    "\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n",
])
def test_an_incomplete_call_is_not_a_call(body: str) -> None:
    with pytest.raises(ValueError):
        parse_qwen3_coder(body, TOOLS)


def test_the_qwen3_coder_format_uses_it() -> None:
    fmt = tool_call_format("qwen3_coder")
    content = big_file()
    (call,) = fmt.parse(xml("write_file", path="x.py", content=content), TOOLS)
    assert call == ToolCall("write_file", {"path": "x.py", "content": content})


def glm(name: str, **params: str) -> str:
    return name + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n"
                          for k, v in params.items())


def test_glm_values_keep_their_text_and_convert_by_schema() -> None:
    from promptcache.engine.formats.tool_formats import parse_glm47

    content = big_file() + "\n  </arg_value> inside a string\n"
    calls = parse_glm47(glm("write_file", path="a.py", content=content, lines="12",
                            options='{"a": [1, true]}', mode="null"), TOOLS)
    assert calls == [{"name": "write_file", "arguments": {
        "path": "a.py", "content": content, "lines": 12, "options": {"a": [1, True]},
        "mode": None}}]
    # the backslash-n some templates write between a key and its value
    literal = "write_file<arg_key>path</arg_key>\\n<arg_value>b.py</arg_value>"
    assert parse_glm47(literal, TOOLS)[0]["arguments"] == {"path": "b.py"}
    assert parse_glm47("write_file", TOOLS) == [{"name": "write_file", "arguments": {}}]


@pytest.mark.parametrize("body", [
    "", "<arg_key>path</arg_key><arg_value>a</arg_value>",
    "write_file<arg_key>path</arg_key>", "write_file<arg_key>path</arg_key><arg_value>a",
    "write_file<arg_key>path</arg_key><arg_value>a</arg_value> trailing text",
])
def test_a_broken_glm_call_is_not_a_call(body: str) -> None:
    from promptcache.engine.formats.tool_formats import parse_glm47

    with pytest.raises(ValueError):
        parse_glm47(body, TOOLS)
