"""Structured output: ``JsonOutput`` (``response_format`` / ``text.format``) and
``ForcedCall`` (``tool_choice``) -> an engine ``Constraint`` for the rendered prompt, in the
model's own tool-call format; an invalid schema or prefill is a 400 naming the field."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...engine.api import Constraint
from ...engine.formats import constrained
from ...engine.formats.chat_format import ChatFormat, ToolCallFormat
from ...engine.formats.constrained import JSON_OPTIONS
from ...engine.port import EngineAPI
from ...errors import RequestError
from ..api.errors import APIError
from .tool_grammar import (
    ToolSpec,
    calls_rule,
    enforces_arguments,
    harmony_calls_rule,
    harmony_final_rule,
    json_rule,
    lit,
    marker,
)

log = logging.getLogger(__name__)

Tools = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class JsonOutput:
    schema: dict[str, Any]
    param: str = "response_format"


@dataclass(frozen=True)
class ForcedCall:
    # the tools the call may use; empty: any offered tool
    names: tuple[str, ...] = ()
    parallel: bool = True
    param: str = "tool_choice"


OutputSpec = JsonOutput | ForcedCall


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, code="invalid_request", param=param)


def _schema(value: Any, param: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _bad(f"{param} must be a JSON Schema object", param)
    return dict(value)


def openai_response_format(value: Any) -> JsonOutput | None:
    """Chat ``response_format``: ``text`` | ``json_object`` | ``json_schema``."""
    if value is None:
        return None
    param = "response_format"
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonOutput({"type": "object"}, param)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping):
            raise _bad("response_format.json_schema must be an object with a 'schema'",
                       "response_format.json_schema")
        schema = _schema(spec.get("schema"), "response_format.json_schema.schema")
        return JsonOutput(schema or {"type": "object"}, "response_format.json_schema.schema")
    raise _bad(f"response_format.type: expected text, json_object or json_schema, got "
               f"{kind!r}", "response_format.type")


def responses_text_format(text: Any) -> JsonOutput | None:
    """Responses ``text.format``: ``text`` | ``json_object`` | ``json_schema`` (flat)."""
    fmt = text.get("format") if isinstance(text, Mapping) else None
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise _bad("text.format must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonOutput({"type": "object"}, "text.format")
    if kind == "json_schema":
        schema = _schema(fmt.get("schema"), "text.format.schema")
        return JsonOutput(schema or {"type": "object"}, "text.format.schema")
    raise _bad(f"text.format.type: expected text, json_object or json_schema, got {kind!r}",
               "text.format.type")


def _named(name: Any, offered: frozenset[str], param: str) -> ForcedCall:
    if not isinstance(name, str) or not name:
        raise _bad(f"{param}: the tool's name must be a non-empty string", param)
    if name not in offered:
        raise _bad(f"{param}: tool {name!r} is not among the offered tools", param)
    return ForcedCall((name,), parallel=False)


def _needs_tools(offered: frozenset[str], param: str) -> None:
    if not offered:
        raise _bad(f"{param} asks for a tool call, but no tools were offered", param)


def openai_tool_choice(choice: Any, offered: frozenset[str], parallel: bool | None,
                       *, responses: bool = False) -> ForcedCall | None:
    """OpenAI chat / Responses ``tool_choice`` (``auto`` / ``none``: nothing to enforce)."""
    param = "tool_choice"
    if choice is None or choice in ("auto", "none"):
        return None
    if choice == "required":
        _needs_tools(offered, param)
        return ForcedCall((), parallel is not False)
    if not isinstance(choice, Mapping):
        raise _bad(f"tool_choice: expected 'auto', 'none', 'required' or an object, got "
                   f"{choice!r}", param)
    kind = choice.get("type")
    if kind == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else choice.get("name")
        _needs_tools(offered, param)
        return _named(name, offered, param)
    if responses and kind == "allowed_tools":
        if choice.get("mode", "auto") != "required":
            return None
        tools = choice.get("tools")
        names = tuple(str(t["name"]) for t in tools or () if isinstance(t, Mapping)
                      and isinstance(t.get("name"), str) and t["name"] in offered)
        _needs_tools(frozenset(names), param)
        return ForcedCall(names, parallel is not False)
    if responses and isinstance(kind, str):
        return None  # a server-side tool (web_search, ...): left out with the tool
    raise _bad(f"tool_choice.type: expected 'function', got {kind!r}", "tool_choice.type")


def anthropic_tool_choice(choice: Mapping[str, Any] | None, offered: frozenset[str]
                          ) -> ForcedCall | None:
    """Anthropic ``tool_choice`` (``any`` / ``tool`` enforced; ``disable_parallel_tool_use``)."""
    if choice is None:
        return None
    kind = choice.get("type")
    parallel = not bool(choice.get("disable_parallel_tool_use"))
    if kind == "any":
        _needs_tools(offered, "tool_choice")
        return ForcedCall((), parallel)
    if kind == "tool":
        _needs_tools(offered, "tool_choice")
        return _named(choice.get("name"), offered, "tool_choice.name")
    return None


def thinking_for(spec: OutputSpec | None, requested: bool | None) -> bool | None:
    """The thinking switch: off for constrained replies unless the request asked for it."""
    if spec is not None and requested is None:
        return False
    return requested


def _tool_specs(tools: Tools | None) -> list[ToolSpec]:
    out = []
    for tool in tools or ():
        fn = tool.get("function")
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out.append(ToolSpec(str(fn["name"]), dict(params) if isinstance(params, Mapping)
                                else {"type": "object", "properties": {}}))
    return out


def _with_options(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The schema with the server's JSON options (its own ``x-guidance`` wins)."""
    opts = {**JSON_OPTIONS, "lenient": True, **dict(schema.get("x-guidance") or {})}
    return {**schema, "x-guidance": opts}


def _reasoning_rules(cf: ChatFormat, opened: bool) -> tuple[str, list[str]]:
    """(the start of ``start``, rules) for a reply that may first reason."""
    end = cf.think_end or ""
    if cf.think_end_token is not None:
        rules = [f"think: /(?s:.*)/ {marker(end, cf.think_end_token)}"]
    else:
        rules = [f"think[suffix={lit(end)}]: /(?s:.*)/"]
    rules.append('think_gap: "\\n" | "\\n\\n"')
    if opened:
        return "think think_gap?", rules
    return f"({marker(cf.think_start or '', cf.think_start_token)} think think_gap?)?", rules


@dataclass(frozen=True)
class PromptShape:
    """What ``constraint_for`` needs to know about the rendered prompt."""

    chat_format: ChatFormat
    tool_format: ToolCallFormat
    tools: Tools | None
    # the reply starts inside a reasoning block / may open one
    in_reasoning: bool = False
    may_reason: bool = False
    # the final assistant message's text when the prompt continues it
    prefill: str | None = None


def constraint_for(spec: OutputSpec, shape: PromptShape) -> Constraint | None:
    """The constraint of ``spec`` for this prompt (None: nothing to enforce)."""
    if shape.chat_format.harmony:
        return _harmony_constraint(spec, shape)
    specs = _tool_specs(shape.tools)
    reason = not shape.prefill and (shape.in_reasoning or shape.may_reason) \
        and shape.chat_format.has_thinking
    rules: list[str] = []
    if isinstance(spec, ForcedCall):
        allowed = [t for t in specs if not spec.names or t.name in spec.names]
        if not allowed:
            return None
        if not enforces_arguments(shape.tool_format):
            log.info("tool-call format %s: a call is forced, its name and arguments are "
                     "the model's", shape.tool_format.name)
        rules += calls_rule(shape.tool_format, allowed, spec.parallel, _json_of)
        # after a prefill's text the call starts on a new line (or after a space)
        answer = '("\\n" | "\\n\\n" | " ")? calls' if shape.prefill else "calls"
        prefix = ""
    else:
        schema = _with_options(spec.schema)
        prefix = shape.prefill or ""
        if not specs and not reason:
            return Constraint("json_schema", json.dumps(schema, ensure_ascii=False),
                              prefix=prefix)
        rules.append(f"answer_json: {json_rule(schema)}")
        answer = "answer_json"
        if specs:  # tool_choice auto: a call, or the JSON answer
            rules += calls_rule(shape.tool_format, specs, True, _json_of)
            answer = "calls | answer_json"
    start = f"start: {answer}"
    if reason:
        head, think = _reasoning_rules(shape.chat_format, shape.in_reasoning)
        start = f"start: {head} ({answer})"
        rules += think
    return Constraint("lark", "\n".join([start, *rules]), prefix=prefix)


def _harmony_constraint(spec: OutputSpec, shape: PromptShape) -> Constraint | None:
    """gpt-oss (prompt ends with ``<|start|>assistant``): a forced call is one commentary
    message to ``functions.N`` ending with ``<|call|>``; a JSON answer the final channel's
    message (or a call, with tools). No analysis message first."""
    cf = shape.chat_format
    if shape.prefill:
        log.info("harmony format: a reply that continues a prefill is not enforced")
        return None
    specs = _tool_specs(shape.tools)
    if isinstance(spec, ForcedCall):
        allowed = [t for t in specs if not spec.names or t.name in spec.names]
        if not allowed:
            return None
        rules = ["start: calls", *harmony_calls_rule(allowed, cf.harmony_token, _json_of)]
    else:
        rules = [harmony_final_rule("answer_json", cf.harmony_token),
                 f"answer_json: {json_rule(_with_options(spec.schema))}"]
        if specs:
            rules = ["start: calls | final", *rules,
                     *harmony_calls_rule(specs, cf.harmony_token, _json_of)]
        else:
            rules = ["start: final", *rules]
    return Constraint("lark", "\n".join(rules))


def _json_of(schema: Mapping[str, Any]) -> str:
    return json_rule(_with_options(schema))


def check_constraint(constraint: Constraint, engine: EngineAPI, param: str) -> None:
    """Compile ``constraint`` (preparation thread); 400 naming ``param`` when invalid."""
    tokenizer, vocab = engine.tokenizer, engine.vocab_size
    try:
        # the engine's own (mlx-lm wrapping a fast Hugging Face) tokenizer: compile
        if constrained.compiles_for(tokenizer):
            constrained.prepare(constraint, tokenizer, vocab)
        else:
            constrained.validate(constraint)
    except RequestError as e:
        raise _bad(f"{param}: {e}", param) from None
