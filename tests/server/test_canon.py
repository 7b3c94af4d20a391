"""Canonical prompts (server/prompts/canon.py): each rule, on by default and switchable, and
what the template is given with them on and off."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from fixtures.traces.make_traces import shuffled

from promptcache.cli import serve_cmd
from promptcache.server import create_app
from promptcache.server.prompts.canon import (
    BILLING_HEADER,
    RULES,
    STRUCTURE_ORDER,
    TOOL_KEYS,
    TOOL_ORDER,
    Canon,
    canonical_keys,
    is_billing_header,
    parse_rules_off,
)
from promptcache.serving_config import ServerConfig

README = Path(__file__).resolve().parents[2] / "docs" / "api.md"  # the API reference


def test_rule_names() -> None:
    assert tuple(RULES) == (BILLING_HEADER, TOOL_KEYS, TOOL_ORDER)
    assert parse_rules_off([]) == frozenset()
    assert parse_rules_off(["tool-keys", "TOOL_ORDER"]) == {TOOL_KEYS, TOOL_ORDER}
    assert parse_rules_off(["all"]) == set(RULES)
    with pytest.raises(ValueError, match="unknown canonicalization rule 'sort'"):
        parse_rules_off(["sort"])
    assert Canon().active == tuple(RULES)
    assert Canon(frozenset({TOOL_KEYS})).active == (BILLING_HEADER, TOOL_ORDER)


def test_every_rule_is_listed_in_the_api_docs() -> None:
    text = README.read_text()
    for rule in RULES:
        assert f"`{rule}`" in text, rule
    assert "--no-canonicalize" in text


@pytest.mark.parametrize("text, header", [
    ("x-anthropic-billing-header: cc_version=2.1.197.3bb; cc_entrypoint=sdk-cli;", True),
    ("x-anthropic-billing-header: cc_version=2.1.197.3bb; cc_entrypoint=sdk-cli; cch=9f2e1;",
     True),
    ("  x-anthropic-billing-header: cc_version=1;\n", True),
    ("x-anthropic-billing-header: cc_version=1", True),
    ("x-anthropic-billing-header: cc_version=1;\nYou are Claude.", False),
    ("x-anthropic-billing-header: cc_version=1;You are Claude.", False),
    ("x-anthropic-billing-header: a", False),
    ("You are Claude. x-anthropic-billing-header: cc_version=1;", False),
    ("X-Anthropic-Billing-Header: cc_version=1;", False),
])
def test_billing_header_recognised(text: str, header: bool) -> None:
    assert is_billing_header(text) is header


def test_billing_header_block_and_line() -> None:
    blocks = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=1;"},
              {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]
    canon = Canon()
    assert canon.system_blocks(blocks) == blocks[1:]
    assert Canon(frozenset({BILLING_HEADER})).system_blocks(blocks) == blocks
    # joined with newlines (a proxy in front), the first line goes
    assert canon.system_text("x-anthropic-billing-header: cch=7;\n\nYou are Claude.") \
        == "You are Claude."
    # joined without a separator it is not a line of its own: left alone
    joined = "x-anthropic-billing-header: cch=7;You are Claude."
    assert canon.system_text(joined) == joined
    msgs = [{"role": "system", "content": "x-anthropic-billing-header: cch=7;"},
            {"role": "user", "content": "x-anthropic-billing-header: cch=7;"}]
    # a leading system message that was only the header is dropped; user text is never touched
    assert canon.messages(msgs) == msgs[1:]
    assert Canon(frozenset({BILLING_HEADER})).messages(msgs) == msgs


def _tool(name: str, keys: list[str]) -> dict[str, Any]:
    props = {k: {"type": "string", "description": f"the {k}"} for k in keys}
    return {"type": "function", "function": {"name": name, "description": f"{name} tool",
                                             "parameters": {"type": "object",
                                                            "properties": props,
                                                            "required": keys}}}


def test_tool_keys_and_order() -> None:
    tools = [_tool("Write", ["path", "content"]), _tool("Bash", ["command", "timeout"])]
    out = Canon().tools(tools)
    assert out is not None
    assert [t["function"]["name"] for t in out] == ["Bash", "Write"]
    # the structure's keys in the conventional order, property names sorted, lists
    # (``required``) in their order
    assert list(out[1]) == ["type", "function"]
    assert list(out[1]["function"]) == ["name", "description", "parameters"]
    assert list(out[1]["function"]["parameters"]) == ["type", "properties", "required"]
    assert list(out[1]["function"]["parameters"]["properties"]) == ["content", "path"]
    assert out[1]["function"]["parameters"]["required"] == ["path", "content"]
    assert Canon(frozenset({TOOL_ORDER})).tools(tools)[0]["function"]["name"] == "Write"  # type: ignore[index]
    kept = Canon(frozenset({TOOL_KEYS, TOOL_ORDER})).tools(tools)
    assert json.dumps(kept) == json.dumps(tools)
    assert canonical_keys({"b": [{"d": 1, "c": 2}], "a": None}) == {"a": None, "b": [{"c": 2, "d": 1}]}


def test_tool_keys_come_in_the_conventional_order() -> None:
    """The order OpenAI's and Hugging Face's tool schemas are written in, whatever the
    client sent: structure keys ranked, other keys sorted after them, and names
    (properties, definitions: a parameter called ``type`` or ``description`` too)
    sorted among themselves."""
    schema = {"required": ["type"], "$schema": "x", "additionalProperties": False,
              "properties": {"type": {"enum": ["a"], "description": "d", "type": "string"},
                             "description": {"items": {"type": "string"}, "type": "array"},
                             "alpha": {"type": "integer", "minimum": 0, "title": "A"}},
              "type": "object", "$defs": {"z": {"type": "string"}, "b": {"type": "integer"}}}
    tool = {"function": {"strict": True, "parameters": schema, "description": "t",
                         "name": "f"}, "type": "function"}
    out = canonical_keys(tool)
    assert json.dumps(out) == json.dumps({"type": "function", "function": {
        "name": "f", "description": "t",
        "parameters": {"type": "object", "properties": {
            "alpha": {"type": "integer", "title": "A", "minimum": 0},
            "description": {"type": "array", "items": {"type": "string"}},
            "type": {"type": "string", "description": "d", "enum": ["a"]}},
            "required": ["type"], "additionalProperties": False,
            "$defs": {"b": {"type": "integer"}, "z": {"type": "string"}}, "$schema": "x"},
        "strict": True}})
    assert STRUCTURE_ORDER[:3] == ("type", "function", "name")
    # any key order in, the same text out
    rng = random.Random(5)
    assert {json.dumps(canonical_keys(shuffled(tool, rng))) for _ in range(20)} \
        == {json.dumps(out)}


CLAUDE_TOOLS = [
    {"name": "Read", "description": "read a file",
     "input_schema": {"type": "object", "properties": {
         "file_path": {"type": "string"}, "offset": {"type": "integer"}},
         "required": ["file_path"]}},
    {"name": "Bash", "description": "run a command",
     "input_schema": {"type": "object", "properties": {
         "command": {"type": "string"}, "timeout": {"type": "integer"}},
         "required": ["command"], "additionalProperties": False}},
    {"name": "Edit", "description": "edit a file",
     "input_schema": {"type": "object", "properties": {
         "file_path": {"type": "string"}, "old_string": {"type": "string"},
         "new_string": {"type": "string"}}}},
]


def _claude_body(turn: int, rng: random.Random, shuffle: bool) -> dict[str, Any]:
    tools = [dict(t) for t in CLAUDE_TOOLS]
    if shuffle:
        rng.shuffle(tools)
        tools = [shuffled(t, rng) for t in tools]
    return {"model": "default", "max_tokens": 16,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: "
                        f"cc_version=2.1.197.{turn:03x}; cc_entrypoint=sdk-cli; cch={turn * 7919:05x};"},
                       {"type": "text", "text": "You are Claude Code.",
                        "cache_control": {"type": "ephemeral"}}],
            "tools": tools,
            "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("off, same", [((), True), (("billing_header",), False),
                                       (("tool_keys",), False), (("tool_order",), False),
                                       (("all",), False)])
def test_claude_code_turns_render_the_same(off: tuple[str, ...], same: bool) -> None:
    """A changing billing header, tools reordered and keys shuffled per request: with
    every rule on the template gets the same messages and tools (so the same tokens);
    with any rule off it does not."""
    engine = FakeEngine()
    client = TestClient(create_app(engine, ServerConfig(canonicalize_off=off)))
    rng = random.Random(7)
    rendered = []
    for turn in range(4):
        r = client.post("/v1/messages", json=_claude_body(turn, rng, shuffle=True))
        assert r.status_code == 200, r.text
        # what the template is given, in its order (the fake renders tools key-sorted)
        rendered.append(json.dumps(engine.rendered[-1]))
    assert (len(set(rendered)) == 1) is same
    messages, tools = engine.rendered[-1]
    if not off:
        assert messages[0] == {"role": "system", "content": "You are Claude Code."}
        assert [t["function"]["name"] for t in tools] == ["Bash", "Edit", "Read"]
        assert json.dumps(tools[0]["function"]["parameters"]) == json.dumps(
            canonical_keys(CLAUDE_TOOLS[1]["input_schema"]))


def test_openai_tools_are_canonical_and_count_tokens_agrees() -> None:
    engine = FakeEngine()
    client = TestClient(create_app(engine, ServerConfig()))
    rng = random.Random(3)
    fn = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                            "parameters": t["input_schema"]}}
          for t in CLAUDE_TOOLS]
    counts = set()
    for _ in range(3):
        tools = shuffled(fn, rng)
        rng.shuffle(tools)
        body = {"model": "default", "max_tokens": 8, "tools": tools,
                "messages": [{"role": "user", "content": "hi"}]}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        counts.add(tuple(engine.submitted[-1].prompt_tokens))
    assert len(counts) == 1
    # count_tokens renders exactly what a turn renders
    body = _claude_body(0, rng, shuffle=True)
    n = client.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
    client.post("/v1/messages", json=body)
    assert n == len(engine.submitted[-1].prompt_tokens)


def test_serve_flag(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    serve_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--no-ssd", "--no-canonicalize", "tool_keys",
                              "--no-canonicalize", "billing-header"])
    *_, server_cfg = serve_cmd.build_configs(args)
    assert server_cfg.canonicalize_off == ("billing_header", "tool_keys")
    args = parser.parse_args(["serve", "--no-ssd", "--no-canonicalize", "nope"])
    with pytest.raises(ValueError, match="unknown canonicalization rule"):
        serve_cmd.build_configs(args)
    with pytest.raises(ValueError, match="unknown canonicalization rule"):
        create_app(FakeEngine(), ServerConfig(canonicalize_off=("nope",)))
