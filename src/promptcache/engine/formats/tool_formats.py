"""Tool-call parsers where mlx-lm's loses calls or has none (Qwen3-Coder, GLM, DeepSeek).

mlx-lm 0.32's qwen3_coder cuts values containing ``</parameter>``, turns "null" strings into None
and drops calls via ``ast.literal_eval``. Here a value ends at a ``</parameter>`` followed by the
next parameter or ``</function>``; values convert by JSON per the schema, else stay text."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

_FUNCTION = re.compile(r"<function=([^\s<>]+)>")
_PARAMETER = re.compile(r"<parameter=([^\s<>]+)>")
_PARAM_END = "</parameter>"
_FUNCTION_END = "</function>"
# after a parameter's end: the next parameter or the function's end
_NEXT = re.compile(r"\s*(?:<parameter=|</function>)")


def _schema_of(name: str, tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    for tool in tools or ():
        fn = tool.get("function")
        if isinstance(fn, Mapping) and fn.get("name") == name:
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, Mapping) else None
            return dict(props) if isinstance(props, Mapping) else {}
    return {}


def _types(schema: Any) -> list[str]:
    """The JSON types a property allows (``type``, a list, ``anyOf`` / ``oneOf``); empty: any."""
    if not isinstance(schema, Mapping):
        return []
    kind = schema.get("type")
    out: list[str] = []
    if isinstance(kind, str):
        out.append(kind.lower())
    elif isinstance(kind, list):
        out += [str(k).lower() for k in kind]
    for key in ("anyOf", "oneOf"):
        for member in schema.get(key) or ():
            out += _types(member)
    if not out and "enum" in schema:
        out.append("string")
    return out


def _as_type(text: str, kind: str) -> tuple[bool, Any]:
    """``text`` as a JSON value of type ``kind``: (True, value) or (False, None)."""
    if kind in ("boolean", "bool"):
        low = text.lower()
        return (True, low == "true") if low in ("true", "false") else (False, None)
    if kind in ("integer", "int", "number", "float"):
        try:
            number = json.loads(text)
        except ValueError:
            return False, None
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            return False, None
        if kind in ("integer", "int"):
            return (True, number) if isinstance(number, int) else (False, None)
        return True, number
    if kind in ("object", "dict", "array", "list"):
        try:
            parsed = json.loads(text, strict=False)
        except (ValueError, RecursionError):
            return False, None
        want = dict if kind in ("object", "dict") else list
        return (True, parsed) if isinstance(parsed, want) else (False, None)
    return False, None


def _convert(value: str, schema: Any) -> Any:
    """A parameter's text as its schema's value; the text itself if a string fits or none does."""
    types = _types(schema)
    text = value.strip()
    if not types:  # no schema: a JSON object / array if it is one, else text
        for kind in ("object", "array"):
            ok, parsed = _as_type(text, kind)
            if ok:
                return parsed
        return value
    stringy = "string" in types
    if "null" in types and text == "null" and (not stringy or value == "null"):
        return None
    if stringy and text != value:
        return value  # whitespace around it: text
    for kind in types:
        if kind in ("string", "null"):
            continue
        ok, converted = _as_type(text, kind)
        if ok:
            return converted
    return value


def _parameters(body: str, schema: Mapping[str, Any]) -> dict[str, Any]:
    args: dict[str, Any] = {}
    pos = 0
    while True:
        m = _PARAMETER.search(body, pos)
        if m is None:
            return args
        name = m.group(1)
        start = m.end()
        # the end is the first </parameter> followed by the next parameter or </function>
        end = -1
        search = start
        while True:
            at = body.find(_PARAM_END, search)
            if at < 0:
                break
            after = at + len(_PARAM_END)
            if _NEXT.match(body, after) or not body[after:].strip():
                end = at
                break
            search = after
        if end < 0:
            raise ValueError(f"parameter {name!r} has no end")
        value = body[start:end]
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        args[name] = _convert(value, schema.get(name))
        pos = end + len(_PARAM_END)


def _function_end(body: str, start: int) -> int:
    """Where the function starting at ``start`` ends: the first ``</function>`` not in a value."""
    pos = start
    while True:
        p = _PARAMETER.search(body, pos)
        f = body.find(_FUNCTION_END, pos)
        if f < 0:
            return -1
        if p is None or f < p.start():
            return f
        search = p.end()
        while True:
            at = body.find(_PARAM_END, search)
            if at < 0:
                return -1
            after = at + len(_PARAM_END)
            if _NEXT.match(body, after) or not body[after:].strip():
                pos = after
                break
            search = after


def parse_qwen3_coder(body: str, tools: Sequence[Mapping[str, Any]] | None = None
                      ) -> list[dict[str, Any]]:
    """The calls in the text between ``<tool_call>`` and ``</tool_call>``."""
    calls: list[dict[str, Any]] = []
    pos = 0
    while True:
        m = _FUNCTION.search(body, pos)
        if m is None:
            break
        end = _function_end(body, m.end())
        if end < 0:
            raise ValueError(f"function {m.group(1)!r} has no </function>")
        name = m.group(1)
        calls.append({"name": name,
                      "arguments": _parameters(body[m.end():end] + _FUNCTION_END,
                                               _schema_of(name, tools))})
        pos = end + len(_FUNCTION_END)
    if not calls:
        raise ValueError("no <function=...> in the tool call")
    return calls



DEEPSEEK_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DEEPSEEK_CALLS_END = "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DEEPSEEK_CALL_END = "<｜tool▁call▁end｜>"
DEEPSEEK_SEP = "<｜tool▁sep｜>"
_FENCE = re.compile(r"^\s*```(?:json)?\s*\n?(.*?)\n?```\s*$", re.DOTALL)


def parse_deepseek(body: str, tools: Sequence[Mapping[str, Any]] | None = None
                   ) -> list[dict[str, Any]]:
    """The calls between DeepSeek V3 / V3.1 tool-call markers; ValueError otherwise."""
    calls: list[dict[str, Any]] = []
    pos = 0
    while True:
        start = body.find(DEEPSEEK_CALL_BEGIN, pos)
        if start < 0:
            break
        end = body.find(DEEPSEEK_CALL_END, start)
        if end < 0:
            raise ValueError("a DeepSeek tool call without its end marker")
        inner = body[start + len(DEEPSEEK_CALL_BEGIN):end]
        head, sep, rest = inner.partition(DEEPSEEK_SEP)
        if not sep:
            raise ValueError("a DeepSeek tool call without <｜tool▁sep｜>")
        name, args_text = head.strip(), rest
        if name == "function":  # V3: the name on the first line, the arguments fenced
            first, _, fenced = rest.partition("\n")
            name = first.strip()
            m = _FENCE.match(fenced)
            args_text = m.group(1) if m else fenced
        if not name:
            raise ValueError("a DeepSeek tool call without a name")
        args = json.loads(args_text) if args_text.strip() else {}
        if not isinstance(args, dict):
            raise ValueError("DeepSeek tool call arguments must be an object")
        calls.append({"name": name, "arguments": args})
        pos = end + len(DEEPSEEK_CALL_END)
    if not calls:
        raise ValueError("no <｜tool▁call▁begin｜> in the tool calls")
    return calls



_ARG_KEY, _ARG_KEY_END = "<arg_key>", "</arg_key>"
_ARG_VALUE, _ARG_VALUE_END = "<arg_value>", "</arg_value>"
# between a key and its value: whitespace, or the two characters backslash-n some templates write
_GAP = re.compile(r"(?:\s|\\n)*")
# after a value's end: the next key or the end of the call
_NEXT_ARG = re.compile(r"(?:\s|\\n)*(?:<arg_key>|$)")


def parse_glm47(body: str, tools: Sequence[Mapping[str, Any]] | None = None
                ) -> list[dict[str, Any]]:
    """The call in GLM's ``NAME<arg_key>K</arg_key><arg_value>V</arg_value>`` format."""
    at = body.find(_ARG_KEY)
    name = (body if at < 0 else body[:at]).strip()
    if not name or any(c in name for c in "<>\n{}"):
        raise ValueError("no function name before the arguments")
    schema = _schema_of(name, tools)
    args: dict[str, Any] = {}
    pos = len(body) if at < 0 else at
    while pos < len(body):
        if not body.startswith(_ARG_KEY, pos):
            if body[pos:].strip():
                raise ValueError("text after the arguments")
            break
        key_end = body.find(_ARG_KEY_END, pos)
        if key_end < 0:
            raise ValueError("an argument key without its end")
        key = body[pos + len(_ARG_KEY):key_end].strip()
        gap = _GAP.match(body, key_end + len(_ARG_KEY_END))
        start = gap.end() if gap else key_end + len(_ARG_KEY_END)
        if not body.startswith(_ARG_VALUE, start):
            raise ValueError(f"argument {key!r} has no value")
        start += len(_ARG_VALUE)
        search, end = start, -1
        while True:
            found = body.find(_ARG_VALUE_END, search)
            if found < 0:
                break
            if _NEXT_ARG.match(body, found + len(_ARG_VALUE_END)):
                end = found
                break
            search = found + len(_ARG_VALUE_END)
        if end < 0:
            raise ValueError(f"argument {key!r} has no end")
        args[key] = _convert(body[start:end], schema.get(key))
        nxt = _GAP.match(body, end + len(_ARG_VALUE_END))
        pos = nxt.end() if nxt else end + len(_ARG_VALUE_END)
    return [{"name": name, "arguments": args}]
