"""Grammars (llguidance's Lark dialect) that force a tool call in the model's own format:
``calls_rule(fmt, tools, parallel, json_of)``, one rule per ``ToolCallFormat`` (else the
markers around free text), so mlx-lm's parser reads the call back."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ...engine.formats.chat_format import ToolCallFormat

JsonOf = Callable[[Mapping[str, Any]], str]


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: dict[str, Any]


def lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def marker(text: str, token_id: int | None) -> str:
    """A marker: the (added) token by id, or its text."""
    return f"<[{token_id}]>" if token_id is not None else lit(text)


def json_rule(schema: Mapping[str, Any]) -> str:
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _properties(schema: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], bool]]:
    """(name, schema, required) of an object schema's properties, in order."""
    props = schema.get("properties")
    required = schema.get("required")
    req = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
    out = []
    if isinstance(props, Mapping):
        for name, sub in props.items():
            out.append((str(name), dict(sub) if isinstance(sub, Mapping) else {},
                        name in req))
    return out


def _start(fmt: ToolCallFormat) -> str:
    return marker(fmt.start, fmt.start_token)


def _end(fmt: ToolCallFormat) -> str:
    return marker(fmt.end, fmt.end_token) if fmt.end else ""


def _json_call(fmt: ToolCallFormat, tool: ToolSpec, i: int, json_of: JsonOf) -> list[str]:
    head = lit('\n{"name": ' + json.dumps(tool.name, ensure_ascii=False) + ', "arguments": ')
    return [f"call_{i}: {_start(fmt)} {head} args_{i} {lit('}' + chr(10))} {_end(fmt)}",
            f"args_{i}: {json_of(tool.parameters)}"]


def _is_string(sub: Mapping[str, Any]) -> bool:
    kind = sub.get("type")
    return kind == "string" or (isinstance(kind, list) and set(kind) <= {"string"} and bool(kind))


def _xml_call(fmt: ToolCallFormat, tool: ToolSpec, i: int, json_of: JsonOf) -> list[str]:
    close = lit("\n</parameter>\n")
    rules: list[str] = []
    items: list[str] = []
    for k, (name, sub, required) in enumerate(_properties(tool.parameters)):
        value, extra = _value(sub, f"v_{i}_{k}", close, json_of)
        rules += extra
        rules.append(f"p_{i}_{k}: {lit(f'<parameter={name}>' + chr(10))} {value}")
        items.append(f"p_{i}_{k}" + ("" if required else "?"))
    head = lit(f"\n<function={tool.name}>\n")
    tail = lit("</function>\n")
    return [f"call_{i}: {_start(fmt)} {head} {' '.join(items)} {tail} {_end(fmt)}", *rules]


def _pythonic_call(fmt: ToolCallFormat, tool: ToolSpec, i: int, json_of: JsonOf) -> list[str]:
    props = _properties(tool.parameters)
    rules = [f"p_{i}_{k}: {lit(name + '=')} {json_of(sub)}"
             for k, (name, sub, _) in enumerate(props)]
    n = len(props)
    # r_k: the parameters from k on, each after ", "; f_k: from k on, the first without
    for k in range(n - 1, -1, -1):
        required = props[k][2]
        rest = f" r_{i}_{k + 1}" if k + 1 < n else ""
        item = f'", " p_{i}_{k}'
        if k > 0:
            rules.append(f"r_{i}_{k}: {item}{rest}" if required else
                         f"r_{i}_{k}: ({item})?{rest}")
        first = f"p_{i}_{k}{rest}"
        if not required and k + 1 < n:
            first += f" | f_{i}_{k + 1}"
        rules.append(f"f_{i}_{k}: {first}")
    args = ""
    if n:
        args = f" f_{i}_0" if any(r for _, _, r in props) else f" f_{i}_0?"
    head = lit(f"[{tool.name}(")
    return [f"call_{i}: {_start(fmt)} {head}{args} {lit(')]')} {_end(fmt)}", *rules]


def _mistral_call(fmt: ToolCallFormat, tool: ToolSpec, i: int, json_of: JsonOf) -> list[str]:
    if fmt.variant == "args":
        return [f"call_{i}: {_start(fmt)} {lit(tool.name + '[ARGS]')} args_{i}",
                f"args_{i}: {json_of(tool.parameters)}"]
    head = lit('[{"name": ' + json.dumps(tool.name, ensure_ascii=False) + ', "arguments": ')
    return [f"call_{i}: {_start(fmt)} {head} args_{i} {lit('}]')}",
            f"args_{i}: {json_of(tool.parameters)}"]


def _generic_call(fmt: ToolCallFormat) -> list[str]:
    if not fmt.end:
        return [f"call_any: {_start(fmt)} /(?s:.+)/"]
    if fmt.end_token is not None:
        return [f"call_any: {_start(fmt)} /(?s:.*)/ {_end(fmt)}"]
    return [f"call_any: {_start(fmt)} call_body", f"call_body[suffix={lit(fmt.end)}]: /(?s:.*)/"]


def _m(fmt: ToolCallFormat, text: str) -> str:
    """One of ``fmt``'s markers: by id when it is an added token, else spelled out."""
    return marker(text, fmt.token_of(text))


def _deepseek_call(fmt: ToolCallFormat, tool: ToolSpec, i: int, json_of: JsonOf) -> list[str]:
    return [f"call_{i}: {_m(fmt, '<｜tool▁call▁begin｜>')} {lit(tool.name)} "
            f"{_m(fmt, '<｜tool▁sep｜>')} args_{i} {_m(fmt, '<｜tool▁call▁end｜>')}",
            f"args_{i}: {json_of(tool.parameters)}"]


def _sectioned_calls(fmt: ToolCallFormat, names: list[str], parallel: bool) -> list[str]:
    """Calls inside one start ... end section (DeepSeek, Kimi-K2)."""
    more = " call*" if parallel else ""
    return [f"call: {' | '.join(names)}", f"calls: {_start(fmt)} call{more} {_end(fmt)}"]


def _value(sub: Mapping[str, Any], name: str, close: str, json_of: JsonOf
           ) -> tuple[str, list[str]]:
    """(expression, extra rules) of one XML-style parameter ending with ``close``: raw
    text for strings (or one of their ``enum``), else JSON of the property's schema."""
    enum = sub.get("enum")
    if _is_string(sub) and isinstance(enum, list) and enum \
            and all(isinstance(e, str) and e for e in enum):
        return "(" + " | ".join(lit(e) for e in enum) + f") {close}", []
    if _is_string(sub) or "type" not in sub:
        return name, [f"{name}[suffix={close}]: /(?s:.*)/"]
    return f"{json_of(sub)} {close}", []


def _glm_call(fmt: ToolCallFormat, tool: ToolSpec, i: int, json_of: JsonOf) -> list[str]:
    rules: list[str] = []
    items: list[str] = []
    close = _m(fmt, "</arg_value>")
    for k, (name, sub, required) in enumerate(_properties(tool.parameters)):
        value, extra = _value(sub, f"v_{i}_{k}", close, json_of)
        rules += extra
        rules.append(f"p_{i}_{k}: {_m(fmt, '<arg_key>')} {lit(name)} {_m(fmt, '</arg_key>')} "
                     f"{_m(fmt, '<arg_value>')} {value}")
        items.append(f"p_{i}_{k}" + ("" if required else "?"))
    return [f"call_{i}: {_start(fmt)} {lit(tool.name)} {' '.join(items)} {_end(fmt)}", *rules]


def _kimi_call(fmt: ToolCallFormat, tool: ToolSpec, i: int, json_of: JsonOf) -> list[str]:
    return [f"call_{i}: {_m(fmt, '<|tool_call_begin|>')} {lit('functions.' + tool.name + ':')} "
            f"/[0-9]{{1,3}}/ {_m(fmt, '<|tool_call_argument_begin|>')} args_{i} "
            f"{_m(fmt, '<|tool_call_end|>')}",
            f"args_{i}: {json_of(tool.parameters)}"]


_BUILDERS: dict[str, Callable[[ToolCallFormat, ToolSpec, int, JsonOf], list[str]]] = {
    "hermes": _json_call, "json_tools": _json_call, "qwen3_coder": _xml_call,
    "pythonic": _pythonic_call, "mistral": _mistral_call, "deepseek": _deepseek_call,
    "glm47": _glm_call, "kimi_k2": _kimi_call,
}
_SECTIONED = ("deepseek", "kimi_k2")
_SEPARATOR = {"hermes": lit("\n"), "json_tools": lit("\n"), "qwen3_coder": lit("\n")}


def enforces_arguments(fmt: ToolCallFormat) -> bool:
    """Whether ``fmt``'s grammar enforces the name and arguments (else only that a call is made)."""
    return fmt.name in _BUILDERS


def calls_rule(fmt: ToolCallFormat, tools: list[ToolSpec], parallel: bool,
               json_of: JsonOf) -> list[str]:
    build = _BUILDERS.get(fmt.name)
    if build is None:
        rules = _generic_call(fmt)
        names = ["call_any"]
    else:
        rules, names = [], []
        for i, tool in enumerate(tools):
            rules += build(fmt, tool, i, json_of)
            names.append(f"call_{i}")
    if fmt.name in _SECTIONED:  # one section start ... end around every call
        return rules + _sectioned_calls(fmt, names, parallel)
    rules.append("call: " + " | ".join(names))
    sep = _SEPARATOR.get(fmt.name)
    more = f"({sep} call)*" if sep else "call*"
    rules.append(f"calls: call {more}" if parallel else "calls: call")
    return rules


HarmonyToken = Callable[[str], int | None]


def harmony_calls_rule(tools: list[ToolSpec], token: HarmonyToken, json_of: JsonOf
                       ) -> list[str]:
    """``calls`` in harmony: one commentary message to ``functions.N``, its JSON
    arguments, ``<|call|>`` (one call). ``token(marker)``: an added token's id."""
    def m(text: str) -> str:
        return marker(text, token(text))

    rules, names = [], []
    for i, tool in enumerate(tools):
        rules += [f"call_{i}: {m('<|channel|>')} {lit('commentary to=functions.' + tool.name + ' ')}"
                  f" {m('<|constrain|>')} {lit('json')} {m('<|message|>')} args_{i} "
                  f"{m('<|call|>')}",
                  f"args_{i}: {json_of(tool.parameters)}"]
        names.append(f"call_{i}")
    return [*rules, "calls: " + " | ".join(names)]


def harmony_final_rule(answer: str, token: HarmonyToken) -> str:
    """``final``: ``answer`` (a rule name) as the message on the final channel."""
    return (f"final: {marker('<|channel|>', token('<|channel|>'))} {lit('final')} "
            f"{marker('<|message|>', token('<|message|>'))} {answer}")
