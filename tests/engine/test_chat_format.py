"""engine/formats/chat_format.py: the tool-call format read from mlx-lm's TokenizerWrapper (as
mlx-lm infers it from the template, or as the checkpoint names it), the special-token
ids of the markers, and ToolCallFormat.parse over mlx-lm's parsers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from models.tiny_models import CHATML_TEMPLATE

from promptcache.engine.formats.chat_format import (
    HERMES,
    OUR_PARSERS,
    ChatFormat,
    ToolCall,
    chat_format_of,
    tool_call_format,
)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}}]


def tokenizer_folder(src: Path, dst: Path, *, template: str | None = None,
                     parser: str | None = None, special: tuple[str, ...] = ()) -> Path:
    """The tiny model's tokenizer files with another chat template, a
    ``tool_parser_type`` and extra special tokens."""
    dst.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / name, dst / name)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    if template is not None:
        config["chat_template"] = template
    if parser is not None:
        config["tool_parser_type"] = parser
    if special:
        tok = json.loads((dst / "tokenizer.json").read_text())
        next_id = 1 + max([*tok["model"]["vocab"].values(), *(t["id"] for t in tok["added_tokens"])])
        for i, text in enumerate(special):
            entry = {"id": next_id + i, "content": text, "single_word": False, "lstrip": False,
                     "rstrip": False, "normalized": False, "special": True}
            tok["added_tokens"].append(entry)
            config["added_tokens_decoder"][str(next_id + i)] = {
                k: v for k, v in entry.items() if k != "id"}
        (dst / "tokenizer.json").write_text(json.dumps(tok))
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def _with(marker: str) -> str:
    """A ChatML template that mentions ``marker`` (what mlx-lm's inference looks for)."""
    return "{#- " + marker + " #}" + CHATML_TEMPLATE


@pytest.mark.parametrize("template,name,start,end,variant", [
    (_with("<tool_call>{{ tool_call.name }}</tool_call>"), "json_tools", "<tool_call>",
     "</tool_call>", ""),
    (_with("<tool_call>\n<function=x>"), "qwen3_coder", "<tool_call>", "</tool_call>", ""),
    (_with("<|tool_call_start|>"), "pythonic", "<|tool_call_start|>", "<|tool_call_end|>", ""),
    (_with("[TOOL_CALLS]name[ARGS]"), "mistral", "[TOOL_CALLS]", "", "args"),
    (_with("[TOOL_CALLS]"), "mistral", "[TOOL_CALLS]", "", "json"),
])
def test_format_inferred_from_the_template(tiny_llama_path: Path, tmp_path: Path, template: str,
                                           name: str, start: str, end: str, variant: str) -> None:
    tok = load_tokenizer(tokenizer_folder(tiny_llama_path, tmp_path / "t", template=template))
    fmt = chat_format_of(tok).tool_format
    assert fmt is not None
    assert (fmt.name, fmt.start, fmt.end, fmt.variant) == (name, start, end, variant)
    assert (fmt.start_token, fmt.end_token, fmt.bare_json) == (None, None, False)
    # ours where mlx-lm's loses calls (engine/formats/tool_formats.py), else mlx-lm's own
    assert fmt.parser is OUR_PARSERS.get(name, tok.tool_parser)


def test_unknown_template_has_no_format(tiny_llama_path: Path) -> None:
    cf = chat_format_of(load_tokenizer(tiny_llama_path))
    assert cf.tool_format is None
    assert cf.tools_format(True) is HERMES and cf.tools_format(False) is HERMES
    assert ChatFormat().tools_format(True) is HERMES


def test_checkpoint_names_the_parser_and_markers_are_special(tiny_llama_path: Path,
                                                             tmp_path: Path) -> None:
    folder = tokenizer_folder(tiny_llama_path, tmp_path / "t", parser="pythonic",
                              special=("<|tool_call_start|>", "<|tool_call_end|>"))
    tok = load_tokenizer(folder)
    fmt = chat_format_of(tok).tool_format
    assert fmt is not None and fmt.name == "pythonic"
    ids = tok.convert_tokens_to_ids(["<|tool_call_start|>", "<|tool_call_end|>"])
    assert (fmt.start_token, fmt.end_token) == tuple(ids) == (1024, 1025)
    cf = chat_format_of(tok)
    # the template renders tools: the model's own format; the tools fallback: Hermes
    assert cf.tools_format(True) == fmt and cf.tools_format(False) is HERMES


def _one(text: str, fmt_name: str, **kw: Any) -> tuple[ToolCall, ...]:
    return tool_call_format(fmt_name, **kw).parse(text, TOOLS)


def test_parse_normalises_what_the_parsers_return() -> None:
    paris = ToolCall("get_weather", {"city": "Paris"})
    assert _one('{"name": "get_weather", "arguments": {"city": "Paris"}}', "json_tools") == (paris,)
    # arguments as a JSON string, "parameters", none at all
    assert _one('{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',
                "json_tools") == (paris,)
    assert HERMES.parse('{"name": "get_weather", "parameters": {"city": "Paris"}}') == (paris,)
    assert HERMES.parse('{"name": "get_weather"}') == (ToolCall("get_weather", {}),)
    # qwen3_coder converts values by the tool's schema
    xml = "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n" \
          "<parameter=days>\n3\n</parameter>\n</function>\n"
    assert _one(xml, "qwen3_coder") == (ToolCall("get_weather", {"city": "Paris", "days": 3}),)
    # several calls in one block
    assert _one('[get_weather(city="Paris"), get_weather(city="Rome", days=2)]', "pythonic") == (
        paris, ToolCall("get_weather", {"city": "Rome", "days": 2}))
    assert _one('get_weather[ARGS]{"city": "Paris"}', "mistral") == (paris,)
    assert _one('[{"name": "get_weather", "arguments": {"city": "Paris"}}]', "mistral") == (paris,)
    assert paris.arguments_json == '{"city": "Paris"}'


@pytest.mark.parametrize("fmt_name,text", [
    ("json_tools", '{"name": "get_weather", "arguments": {"city": '),
    ("json_tools", '["get_weather"]'),
    ("json_tools", '{"name": 3}'),
    ("json_tools", '{"name": "get_weather", "arguments": [1]}'),
    ("json_tools", '{"name": "get_weather", "arguments": "{oops"}'),
    ("json_tools", "[]"),
    ("qwen3_coder", "\n<function=get_weather>\n<parameter=city>\nParis"),
    ("pythonic", "not a call"),
    ("mistral", "get_weather[ARGS]{cut"),
])
def test_parse_rejects_non_calls(fmt_name: str, text: str) -> None:
    with pytest.raises(ValueError):
        _one(text, fmt_name)


def test_unknown_parser_name() -> None:
    with pytest.raises(ValueError, match="no tool parser"):
        tool_call_format("nope")
    with pytest.raises(ValueError, match="invalid"):
        tool_call_format("../x")


def test_special_reasoning_markers_have_ids(tiny_llama_path: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(tokenizer_folder(tiny_llama_path, tmp_path / "t",
                                          special=("<think>", "</think>")))
    cf = chat_format_of(tok)
    assert (cf.think_start, cf.think_end) == ("<think>", "</think>")
    assert (cf.think_start_token, cf.think_end_token) == (1024, 1025)
    plain = chat_format_of(load_tokenizer(tiny_llama_path))
    assert (plain.think_start, plain.think_start_token, plain.think_end_token) == (None,) * 3
