"""Each tiny family's chat template (``tests/models/family_templates.py``), rendered by the
real tokenizer as mlx-lm loads it: a conversation with a tool call and its result comes
out in the family's published format (exact texts), every added token is one token, the
format promptcache detects from the template is the one docs/cache.md's matrix table names,
and the text the template writes for a call is a call for the family's own parser."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from models import tiny_families as tf

from promptcache.engine.formats.chat_format import ChatFormat, chat_format_of

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
        "required": ["city"]}}}]
ARGS = {"city": "Paris", "days": 2}
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": ARGS}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "assistant", "content": " It is sunny."},
    {"role": "user", "content": "Thanks"},
]
FAMILIES = [f for f in tf.FAMILIES if f != "qwen3_4bit"]  # qwen3's template

_JSON = '{"city": "Paris", "days": 2}'
_XML = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
_QWEN_RESULT = "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
_HERMES = '<tool_call>\n{"name": "get_weather", "arguments": ' + _JSON + '}\n</tool_call>'
# family -> (the call as the template writes it: the reply the model writes after the
# generation prompt; the tool result's turn; the end of the prompt)
RENDERED: dict[str, tuple[str | None, str, str]] = {
    "llama": ('{"name": "get_weather", "parameters": ' + _JSON + "}",
              "<|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|>",
              "Thanks<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    "qwen3": (_HERMES, _QWEN_RESULT, "Thanks<|im_end|>\n<|im_start|>assistant\n"),
    "qwen3_moe": (_XML, _QWEN_RESULT, "Thanks<|im_end|>\n<|im_start|>assistant\n"),
    "qwen3_next": (_XML, _QWEN_RESULT, "Thanks<|im_end|>\n<|im_start|>assistant\n"),
    "qwen3_5": (_XML, _QWEN_RESULT, "Thanks<|im_end|>\n<|im_start|>assistant\n<think>\n"),
    "qwen3_5_moe": (_XML, _QWEN_RESULT, "Thanks<|im_end|>\n<|im_start|>assistant\n<think>\n"),
    "nemotron_h": (_XML, _QWEN_RESULT, "Thanks<|im_end|>\n<|im_start|>assistant\n<think>\n"),
    "falcon_h1": (_HERMES, _QWEN_RESULT, "Thanks<|im_end|>\n<|im_start|>assistant\n"),
    "gemma3_text": (None, "<start_of_turn>user\nsunny<end_of_turn>\n",
                    "Thanks<end_of_turn>\n<start_of_turn>model\n"),
    "gpt_oss": ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                + _JSON + "<|call|>",
                "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
                "sunny<|end|>",
                "<|start|>user<|message|>Thanks<|end|><|start|>assistant"),
    "deepseek_v3": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                    + _JSON + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
                    "<｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜> It is sunny.",
                    "<｜User｜>Thanks<｜Assistant｜></think>"),
    "glm4_moe_lite": ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris"
                      "</arg_value><arg_key>days</arg_key><arg_value>2</arg_value>"
                      "</tool_call>",
                      "<|observation|><tool_response>sunny</tool_response>",
                      "<|user|>Thanks<|assistant|><think>"),
    "kimi_linear": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                    "<|tool_call_argument_begin|>" + _JSON
                    + "<|tool_call_end|><|tool_calls_section_end|>",
                    "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n"
                    "sunny<|im_end|>",
                    "<|im_user|>user<|im_middle|>Thanks<|im_end|>"
                    "<|im_assistant|>assistant<|im_middle|>"),
}
# family -> (tool format name or None, harmony, the thinking switch the template reads)
DETECTED: dict[str, tuple[str | None, bool, str | None]] = {
    "llama": (None, False, None), "qwen3": ("json_tools", False, "enable_thinking"),
    "qwen3_moe": ("qwen3_coder", False, None), "qwen3_next": ("qwen3_coder", False, None),
    "qwen3_5": ("qwen3_coder", False, "enable_thinking"),
    "qwen3_5_moe": ("qwen3_coder", False, "enable_thinking"),
    "nemotron_h": ("qwen3_coder", False, "enable_thinking"),
    "falcon_h1": ("json_tools", False, None), "gemma3_text": (None, False, None),
    "gpt_oss": (None, True, None), "deepseek_v3": ("deepseek", False, "thinking"),
    "glm4_moe_lite": ("glm47", False, "enable_thinking"), "kimi_linear": ("kimi_k2", False, None),
}


def tokenizer_folder(family: str, root: Path) -> Path:
    """A folder with the family's tokenizer files only (what the template test needs)."""
    out = root / family
    out.mkdir()
    (out / "tokenizer.json").write_text(tf.family_tokenizer_json(family))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tf.family_tokenizer_config(family), ensure_ascii=False))
    (out / "config.json").write_text(json.dumps(tf.family_config(family)))
    return out


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Any]:
    root = tmp_path_factory.mktemp("family-tokenizers")
    loaded: dict[str, Any] = {}

    def get(family: str) -> Any:
        if family not in loaded:
            loaded[family] = load_tokenizer(tokenizer_folder(family, root))
        return loaded[family]

    return get


def render(tok: Any, messages: list[dict[str, Any]], **kw: Any) -> str:
    text = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                   tokenize=False, **kw)
    assert isinstance(text, str)
    return text


@pytest.mark.parametrize("family", FAMILIES)
def test_conversation_renders_in_the_published_format(tokenizer: Callable[[str], Any],
                                                      family: str) -> None:
    tok = tokenizer(family)
    text = render(tok, CONVERSATION)
    call, result, end = RENDERED[family]
    if call is not None:
        assert text.count(call) == 1
        assert text.index(call) < text.index(result)
    else:  # Gemma 3 has no tools: the server's fallback puts them into the first turn
        assert "get_weather" not in text
    assert text.count(result) == 1 and text.endswith(end)
    assert text.count("Weather in Paris?") == 1 and text.count(" It is sunny.") == 1
    # the text round-trips through the tokenizer; each added token is one token
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    chat = tf.family_chat(family)
    for marker in (*chat.added, *chat.plain):
        assert len(tok.encode(marker, add_special_tokens=False)) == 1, marker
    assert tok.eos_token == chat.eos[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_detected_format_is_the_tables(tokenizer: Callable[[str], Any], family: str
                                           ) -> None:
    cf = chat_format_of(tokenizer(family))
    name, harmony, switch = DETECTED[family]
    assert (cf.tool_format.name if cf.tool_format else None, cf.harmony,
            cf.thinking_kwarg) == (name, harmony, switch)
    # docs/cache.md's matrix column names it (the Hermes fallback when none is detected)
    assert tf.TOOL_FORMATS[family].startswith(name or ("harmony" if harmony else "hermes"))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "nemotron_h", "glm4_moe_lite",
                                    "deepseek_v3"])
def test_thinking_off_closes_the_reasoning(tokenizer: Callable[[str], Any], family: str
                                           ) -> None:
    tok = tokenizer(family)
    switch = chat_format_of(tok).thinking_kwarg
    assert switch is not None
    off = render(tok, CONVERSATION, **{switch: False})
    on = render(tok, CONVERSATION, **{switch: True})
    tails = {"qwen3": ("<|im_start|>assistant\n<think>\n\n</think>\n\n",
                       "<|im_start|>assistant\n"),
             "qwen3_5": ("<|im_start|>assistant\n<think>\n\n</think>\n\n",
                         "<|im_start|>assistant\n<think>\n"),
             "nemotron_h": ("<|im_start|>assistant\n<think></think>",
                            "<|im_start|>assistant\n<think>\n"),
             "glm4_moe_lite": ("<|assistant|></think>", "<|assistant|><think>"),
             "deepseek_v3": ("<｜Assistant｜></think>", "<｜Assistant｜><think>")}
    want_off, want_on = tails[family]
    assert off.endswith(want_off) and on.endswith(want_on)


def test_added_token_markers_have_ids(tokenizer: Callable[[str], Any]) -> None:
    """Markers that are one added token are known by id (a grammar names them so:
    llguidance treats every added token as special), Qwen's non-special ones too."""
    ids = tf.family_special_ids("glm4_moe_lite")
    fmt = chat_format_of(tokenizer("glm4_moe_lite")).tool_format
    assert fmt is not None
    assert (fmt.start_token, fmt.end_token) == (ids["<tool_call>"], ids["</tool_call>"])
    assert dict(fmt.markers) == {m: ids[m] for m in ("<arg_key>", "</arg_key>",
                                                     "<arg_value>", "</arg_value>")}
    qwen = chat_format_of(tokenizer("qwen3"))
    q_ids = tf.family_special_ids("qwen3")
    assert qwen.tool_format is not None and qwen.tool_format.start_token == q_ids["<tool_call>"]
    assert (qwen.think_start_token, qwen.think_end_token) == (q_ids["<think>"],
                                                               q_ids["</think>"])
    harmony: ChatFormat = chat_format_of(tokenizer("gpt_oss"))
    h_ids = tf.family_special_ids("gpt_oss")
    assert dict(harmony.harmony_tokens) == {m: h_ids[m] for m in (
        "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
        "<|call|>")}
