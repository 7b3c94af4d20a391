"""engine/formats/constrained.py: llguidance grammars as mlx-lm logits processors.

Exact masks on the tiny tokenizer; generation through mlx-lm's own ``generate_step``
(``logits_processors=[...]``) on the tiny random-weight llama, whose output only the
constraint can make well-formed; forced tool calls in each tool-call format, read back by
mlx-lm's parser of that format; SmolLM2 for a realistic JSON answer (slow)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from promptcache.engine.api import Constraint
from promptcache.engine.formats import constrained
from promptcache.engine.formats.chat_format import (
    HERMES,
    ChatFormat,
    ToolCallFormat,
    tool_call_format,
)
from promptcache.errors import RequestError
from promptcache.server.prompts.structured import (
    ForcedCall,
    JsonOutput,
    PromptShape,
    constraint_for,
)
from promptcache.server.replies.toolcalls import parse_tool_calls

VOCAB = 1024


@pytest.fixture(scope="module")
def tiny(tiny_llama_path: Path) -> tuple[Any, Any]:
    model, tok = load(str(tiny_llama_path))
    return model, tok


def generate(model: Any, tok: Any, constraint: Constraint, max_tokens: int = 400,
             prompt: str = "Answer:") -> tuple[str, bool]:
    """Greedy generation under ``constraint``: (text, ended with EOS)."""
    proc = constrained.logits_processor(constraint, tok, VOCAB if len(tok) <= VOCAB else len(tok))
    ids = mx.array(tok.encode(prompt))
    out: list[int] = []
    for t, _ in generate_step(ids, model, logits_processors=[proc], max_tokens=max_tokens):
        if int(t) in tok.eos_token_ids:
            return tok.decode(out), True
        out.append(int(t))
    return tok.decode(out), False


# --- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize("constraint,reason", [
    (Constraint("json_schema", '{"type": "foo"}'), "Invalid type: foo"),
    (Constraint("json_schema", '{"$ref": "#/nope"}'), "/nope"),
    (Constraint("json_schema", '{"type": "string", "minLength": "x"}'), "minLength"),
    (Constraint("json_schema", '{"type": "object"'), "not valid JSON"),
    (Constraint("json_schema", "[1]"), "must be an object"),
    (Constraint("regex", "(unclosed"), "regular expression"),
    (Constraint("lark", "start: nothere"), "grammar"),
])
def test_invalid_constraints_are_request_errors(constraint: Constraint, reason: str,
                                                tiny: tuple[Any, Any]) -> None:
    with pytest.raises(RequestError, match=re.escape(reason)):
        constrained.validate(constraint)
    with pytest.raises(RequestError, match=re.escape(reason)):
        constrained.logits_processor(constraint, tiny[1], VOCAB)


def test_valid_constraints(tiny: tuple[Any, Any]) -> None:
    for c in [Constraint("json_schema", '{"type": "object"}'), Constraint("regex", "a+"),
              Constraint("lark", 'start: "x" %json {"type": "integer"}')]:
        constrained.validate(c)
        constrained.prepare(c, tiny[1], VOCAB)


# --- masks ----------------------------------------------------------------------------------


def _texts(tok: Any) -> list[str]:
    return [tok.decode([i]) for i in range(VOCAB)]


def test_mask_is_exact_and_only_masks(tiny: tuple[Any, Any]) -> None:
    _, tok = tiny
    texts = _texts(tok)
    proc = constrained.logits_processor(Constraint("regex", "(yes|no)!"), tok, VOCAB)
    logits = mx.arange(VOCAB, dtype=mx.float32)[None] / 7.0
    prompt = mx.array(tok.encode("Q?"))
    out = proc(prompt, logits)
    allowed = {i for i, v in enumerate(np.array(out[0]).tolist()) if v != -np.inf}
    expected = {i for i, t in enumerate(texts) if t and i not in tok.eos_token_ids
                and any(w.startswith(t) for w in ("yes!", "no!"))}
    assert allowed == expected and allowed
    kept = np.array(out[0])[sorted(allowed)]
    assert np.array_equal(kept, np.array(logits[0])[sorted(allowed)])  # values untouched
    # feed "yes!" token by token (the processor reads what was appended since)
    seq = list(tok.encode("Q?"))
    for t in tok.encode("yes!"):
        seq.append(t)
        out = proc(mx.array(seq), logits)
    assert {i for i, v in enumerate(np.array(out[0]).tolist()) if v != -np.inf} \
        == set(tok.eos_token_ids)


def test_rejected_token_ends_the_reply(tiny: tuple[Any, Any]) -> None:
    _, tok = tiny
    proc = constrained.logits_processor(Constraint("regex", "yes"), tok, VOCAB)
    logits = mx.zeros((1, VOCAB))
    proc(mx.array([5, 6]), logits)
    bad = tok.encode("zzz")[0]
    out = proc(mx.array([5, 6, bad]), logits)
    assert isinstance(proc, constrained.GrammarProcessor) and proc.failed
    assert {i for i, v in enumerate(np.array(out[0]).tolist()) if v != -np.inf} \
        == set(tok.eos_token_ids)


def test_wider_logits_are_masked_beyond_the_vocabulary(tiny: tuple[Any, Any]) -> None:
    _, tok = tiny
    proc = constrained.logits_processor(Constraint("regex", "[a-z]+"), tok, VOCAB)
    out = proc(mx.array([5]), mx.zeros((1, VOCAB + 8)))
    assert out.shape == (1, VOCAB + 8)
    assert np.all(np.array(out[0, VOCAB:]) == -np.inf)


def test_processors_have_their_own_state(tiny: tuple[Any, Any]) -> None:
    _, tok = tiny
    c = Constraint("regex", "(yes|no)")
    a, b = (constrained.logits_processor(c, tok, VOCAB) for _ in range(2))
    logits = mx.zeros((1, VOCAB))
    a(mx.array([5]), logits)
    b(mx.array([5]), logits)
    y = tok.encode("yes")
    out_a = a(mx.array([5, *y]), logits)
    out_b = b(mx.array([5]), logits)  # nothing new for b
    assert {i for i, v in enumerate(np.array(out_a[0]).tolist()) if v != -np.inf} \
        == set(tok.eos_token_ids)
    assert int(mx.sum(out_b[0] != -np.inf).item()) > len(tok.eos_token_ids)


# --- generation on the tiny random model -----------------------------------------------------

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "days": {"type": "integer", "minimum": 1, "maximum": 9},
    "unit": {"enum": ["c", "f"]},
    "ok": {"type": "boolean"}},
    "required": ["city", "days", "unit", "ok"], "additionalProperties": False}


def _check(value: Any) -> None:
    assert set(value) == {"city", "days", "unit", "ok"}
    assert isinstance(value["city"], str) and len(value["city"]) <= 8
    assert isinstance(value["days"], int) and 1 <= value["days"] <= 9
    assert value["unit"] in ("c", "f") and isinstance(value["ok"], bool)


def test_json_schema_output_matches(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    text, eos = generate(model, tok, Constraint("json_schema", json.dumps(SCHEMA)))
    assert eos, text
    _check(json.loads(text))


def test_prefix_is_continued(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    prefix = '{"city": "Par'
    text, eos = generate(model, tok, Constraint("json_schema", json.dumps(SCHEMA), prefix=prefix))
    assert eos and not text.startswith("{")
    value = json.loads(prefix + text)
    _check(value)
    assert value["city"].startswith("Par")
    with pytest.raises(RequestError, match="prefill 'Sure' does not match"):
        constrained.prepare(Constraint("json_schema", json.dumps(SCHEMA), prefix="Sure"), tok,
                            VOCAB)


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "metric": {"type": "boolean"}},
    "required": ["city", "days"], "additionalProperties": False}}}
OTHER = {"type": "function", "function": {"name": "list_files", "parameters": {
    "type": "object", "properties": {}}}}
FORMATS = {
    "hermes": HERMES,
    "json_tools": tool_call_format("json_tools"),
    "qwen3_coder": tool_call_format("qwen3_coder"),
    "pythonic": tool_call_format("pythonic"),
    "mistral-args": tool_call_format("mistral", variant="args"),
    "mistral-json": tool_call_format("mistral", variant="json"),
}


@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
@pytest.mark.parametrize("names", [(), ("get_weather",)])
def test_forced_tool_call_in_every_format(tiny: tuple[Any, Any], fmt_name: str,
                                          names: tuple[str, ...]) -> None:
    """The grammar writes a call the way the format does; mlx-lm's parser reads it."""
    model, tok = tiny
    fmt: ToolCallFormat = FORMATS[fmt_name]
    c = constraint_for(ForcedCall(names, parallel=False),
                       PromptShape(ChatFormat(), fmt, [TOOL, OTHER]))
    assert c is not None and c.kind == "lark"
    text, eos = generate(model, tok, c)
    assert eos, text
    assert text.startswith(fmt.start) and (not fmt.end or text.endswith(fmt.end))
    parsed = parse_tool_calls(text, {"get_weather", "list_files"}, fmt, [TOOL, OTHER])
    assert parsed.text == "" and len(parsed.tool_calls) == 1, text
    call = parsed.tool_calls[0]
    if names or call.name == "get_weather":
        assert call.name == "get_weather"
        args = call.arguments
        assert args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 9
        assert set(args) <= {"city", "days", "metric"}
        assert isinstance(args.get("metric", True), bool)
    else:
        assert call == type(call)("list_files", {})


def test_json_answer_or_a_call(tiny: tuple[Any, Any]) -> None:
    """response_format with tools offered (tool_choice auto): a call or the JSON answer."""
    model, tok = tiny
    c = constraint_for(JsonOutput(SCHEMA), PromptShape(ChatFormat(), HERMES, [TOOL]))
    assert c is not None and c.kind == "lark" and "answer_json" in c.spec
    text, eos = generate(model, tok, c)
    assert eos
    parsed = parse_tool_calls(text, {"get_weather"}, HERMES, [TOOL])
    if not parsed.tool_calls:
        _check(json.loads(text))


def test_reasoning_before_the_answer(tiny: tuple[Any, Any]) -> None:
    """A reply that starts inside a reasoning block reasons up to the end marker first."""
    model, tok = tiny
    cf = ChatFormat("<think>", "</think>", "enable_thinking")
    c = constraint_for(JsonOutput({"type": "object", "properties": {
        "ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}),
        PromptShape(cf, HERMES, None, in_reasoning=True))
    assert c is not None
    m = constrained._llg().LLMatcher(constrained.ll_tokenizer(tok, VOCAB),
                                     constrained.grammar_of(c), log_level=0)
    assert m.consume_tokens(tok.encode('let me think </think>\n\n{"ok": true}'))
    assert m.is_accepting()
    m.reset()  # the answer comes after the reasoning, not instead of it
    assert m.consume_tokens(tok.encode('{"ok": true}')) and not m.is_accepting()


@pytest.mark.slow
def test_smollm2_json(default_model_path: Path) -> None:
    model, tok = load(str(default_model_path))
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                               "capital": {"type": "string", "maxLength": 40}},
              "required": ["name", "capital"], "additionalProperties": False}
    c = Constraint("json_schema", json.dumps(schema))
    prompt = tok.apply_chat_template([{"role": "user", "content": "France as JSON."}],
                                     add_generation_prompt=True, tokenize=False)
    proc = constrained.logits_processor(c, tok, model.args.vocab_size)
    out: list[int] = []
    for t, _ in generate_step(mx.array(tok.encode(prompt)), model, logits_processors=[proc],
                              max_tokens=80):
        if int(t) in tok.eos_token_ids:
            break
        out.append(int(t))
    value = json.loads(tok.decode(out))
    assert set(value) == {"name", "capital"}


def test_json_whitespace_is_bounded(tiny: tuple[Any, Any]) -> None:
    """None, one space, or a newline and up to 16 spaces / tabs between JSON tokens."""
    _, tok = tiny
    c = Constraint("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
    ll = constrained.ll_tokenizer(tok, VOCAB)

    def accepts(text: str) -> bool:
        m = constrained._llg().LLMatcher(ll, constrained.grammar_of(c), log_level=0)
        return bool(m.consume_tokens(tok.encode(text)) and m.is_accepting())

    assert accepts('{"a":1}') and accepts('{"a": 1}') and accepts('{\n  "a": 1\n}')
    assert accepts('{\n' + " " * 16 + '"a": 1}') and accepts('{\n\t"a": 1}')
    assert not accepts('{"a":  1}')  # two spaces
    assert not accepts('{\n' + " " * 17 + '"a": 1}')
    assert not accepts('{\n\n"a": 1}')  # two newlines


def test_compiled_matchers_are_cached_per_tokenizer(tiny: tuple[Any, Any]) -> None:
    _, tok = tiny
    first = Constraint("regex", "cached[0-9]")
    m = constrained._compiled_matcher(first, tok, VOCAB)
    assert constrained._compiled_matcher(first, tok, VOCAB) is m
    # a copy per request: the cached matcher never moves
    proc = constrained.logits_processor(first, tok, VOCAB)
    assert isinstance(proc, constrained.GrammarProcessor) and proc.matcher is not m
    for i in range(constrained._COMPILED_MAX):  # least recently used out
        constrained.prepare(Constraint("regex", f"other{i}"), tok, VOCAB)
    assert constrained._compiled_matcher(first, tok, VOCAB) is not m


def test_reasoning_markers_that_are_special_tokens_are_named_by_id() -> None:
    cf = ChatFormat("<think>", "</think>", "enable_thinking", think_start_token=7,
                    think_end_token=8)
    c = constraint_for(JsonOutput({"type": "object"}), PromptShape(cf, HERMES, None,
                                                                   may_reason=True))
    assert c is not None
    lines = c.spec.splitlines()
    assert lines[0] == "start: (<[7]> think think_gap?)? (answer_json)"
    assert "think: /(?s:.*)/ <[8]>" in lines
    constrained.validate(c)


def test_penalties_spare_the_end_of_turn_tokens() -> None:
    """Every earlier chat turn ends with an end-of-turn token, so a repetition penalty
    over the context would push a reply away from ending (a 135M model then writes to
    its token limit): the penalties leave those tokens' logits as they were."""
    from mlx_lm.sample_utils import make_logits_processors

    rep, pres, freq = make_logits_processors(repetition_penalty=2.0, presence_penalty=0.5,
                                             frequency_penalty=0.25, repetition_context_size=8,
                                             presence_context_size=8, frequency_context_size=8)
    context = mx.array([5, 2, 7, 5, 2], dtype=mx.uint32)  # 2: the end-of-turn token
    logits = mx.array([[1.0, 1.0, 4.0, 1.0, 1.0, 3.0, 1.0, -2.0]])
    got = constrained.sparing(rep, {2})(context, mx.array(logits))
    assert got.tolist() == [[1.0, 1.0, 4.0, 1.0, 1.0, 1.5, 1.0, -4.0]]
    got = constrained.sparing(pres, {2})(context, mx.array(logits))
    assert got.tolist() == [[1.0, 1.0, 4.0, 1.0, 1.0, 2.5, 1.0, -2.5]]
    got = constrained.sparing(freq, [2, 3])(context, mx.array(logits))
    assert got.tolist() == [[1.0, 1.0, 4.0, 1.0, 1.0, 2.5, 1.0, -2.25]]
    # unspared, the same penalty lowers the end-of-turn token too
    assert rep(context, mx.array(logits)).tolist()[0][2] == 2.0
    # nothing to spare: the penalty itself
    assert constrained.sparing(rep, ()) is rep
