"""OpenAI / Anthropic messages -> the plain chat-template messages the engine renders.

The template messages follow the Hugging Face convention: ``{"role", "content"}``,
assistant ``tool_calls`` as ``[{"id", "type": "function", "function": {"name",
"arguments": dict}}]``, and ``{"role": "tool", "tool_call_id", "content"}``. Tools are
passed in the OpenAI function format (``{"type": "function", "function": {...}}``),
which is what chat templates expect. Every mistake raises ``ValueError``.
"""

from __future__ import annotations

import json
from typing import Any

from .schemas import AnthropicMessage, AnthropicTool, OAIMessage

OPENAI_ROLES = ("system", "developer", "user", "assistant", "tool")


def _text_of_parts(parts: list[dict[str, Any]], where: str) -> str:
    texts = []
    for i, part in enumerate(parts):
        ptype = part.get("type")
        if ptype in ("text", "input_text", "output_text"):
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{where}.content[{i}].text must be a string")
            texts.append(text)
        elif ptype in ("image_url", "image", "input_image", "input_audio", "document", "file"):
            raise ValueError(f"{where}.content[{i}]: content type {ptype!r} is not supported "
                             "(text-only model)")
        else:
            raise ValueError(f"{where}.content[{i}]: unknown content part type {ptype!r}")
    return "".join(texts)


def _arguments(value: str | dict[str, Any], where: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value) if value.strip() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: function arguments are not valid JSON: {e.msg}") from e
    if not isinstance(parsed, dict):
        raise ValueError(f"{where}: function arguments must be a JSON object")
    return parsed


def openai_messages(messages: list[OAIMessage]) -> list[dict[str, Any]]:
    if not messages:
        raise ValueError("messages must not be empty")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role not in OPENAI_ROLES:
            raise ValueError(f"{where}.role: unknown role {m.role!r} "
                             f"(expected one of {', '.join(OPENAI_ROLES)})")
        role = "system" if m.role == "developer" else m.role
        content = m.content
        text = _text_of_parts(content, where) if isinstance(content, list) else (content or "")
        msg: dict[str, Any] = {"role": role, "content": text}
        if m.tool_calls:
            if role != "assistant":
                raise ValueError(f"{where}: only assistant messages may carry tool_calls")
            msg["tool_calls"] = [
                {"id": tc.id or f"call_{i}_{j}", "type": "function",
                 "function": {"name": tc.function.name,
                              "arguments": _arguments(tc.function.arguments,
                                                      f"{where}.tool_calls[{j}]")}}
                for j, tc in enumerate(m.tool_calls)
            ]
        elif content is None and role != "assistant":
            raise ValueError(f"{where}.content must not be null for role {role!r}")
        if role == "tool":
            if m.tool_call_id:
                msg["tool_call_id"] = m.tool_call_id
        if m.name and role != "tool":
            msg["name"] = m.name
        out.append(msg)
    return out


def openai_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    for i, t in enumerate(tools):
        fn = t.get("function")
        if t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': "
                             "{'name': ..., 'parameters': ...}}")
    return tools


def _system_text(system: str | list[dict[str, Any]] | None) -> str | None:
    if system is None:
        return None
    if isinstance(system, str):
        return system
    return _text_of_parts(system, "system")


def _tool_result_text(block: dict[str, Any], where: str) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return _text_of_parts(content, where)
    raise ValueError(f"{where}.content must be a string or a list of text blocks")


def anthropic_messages(messages: list[AnthropicMessage],
                       system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if not messages:
        raise ValueError("messages must not be empty")
    out: list[dict[str, Any]] = []
    sys_text = _system_text(system)
    if sys_text:
        out.append({"role": "system", "content": sys_text})
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role not in ("user", "assistant"):
            raise ValueError(f"{where}.role: unknown role {m.role!r} (expected user or assistant)")
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        tool_calls: list[dict[str, Any]] = []
        for j, block in enumerate(m.content):
            bw = f"{where}.content[{j}]"
            btype = block.get("type")
            if btype == "text":
                if not isinstance(block.get("text"), str):
                    raise ValueError(f"{bw}.text must be a string")
                texts.append(block["text"])
            elif btype == "tool_use" and m.role == "assistant":
                name, args = block.get("name"), block.get("input", {})
                if not isinstance(name, str) or not isinstance(args, dict):
                    raise ValueError(f"{bw}: tool_use needs a string 'name' and an object 'input'")
                tool_calls.append({"id": str(block.get("id") or f"toolu_{i}_{j}"),
                                   "type": "function",
                                   "function": {"name": name, "arguments": args}})
            elif btype == "tool_result" and m.role == "user":
                out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": _tool_result_text(block, bw)})
            elif btype in ("thinking", "redacted_thinking"):
                continue  # not replayed into the prompt
            elif btype in ("image", "document"):
                raise ValueError(f"{bw}: content type {btype!r} is not supported (text-only model)")
            else:
                raise ValueError(f"{bw}: unexpected content block type {btype!r} "
                                 f"for role {m.role!r}")
        if texts or tool_calls or not m.content:
            msg: dict[str, Any] = {"role": m.role, "content": "".join(texts)}
            if tool_calls:
                msg["tool_calls"] = tool_calls
            out.append(msg)
    return out


def anthropic_tools(tools: list[AnthropicTool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [{"type": "function",
             "function": {"name": t.name, "description": t.description or "",
                          "parameters": t.input_schema or {"type": "object", "properties": {}}}}
            for t in tools]
