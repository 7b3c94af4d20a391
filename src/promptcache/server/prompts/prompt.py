"""OpenAI / Anthropic messages -> chat-template messages (mistakes are ``ValueError``), and
two rewrites for templates that cannot show a conversation as it is:
``place_system_messages`` (a mid-conversation system message stays where it stands, never
hoisted) and ``tools_into_system`` (dropped tools go into the system turn, Hermes format)."""

from __future__ import annotations

import json
from typing import Any

from ..api.schemas import AnthropicMessage, AnthropicTool, OAIMessage
from .images import ImageCollector, ImageSource

OPENAI_ROLES = ("system", "developer", "user", "assistant", "tool")


IMAGE_PARTS = ("image_url", "image", "input_image")


def image_part(part: dict[str, Any], where: str, images: ImageCollector, param: str) -> str:
    """Collect the image of an image part (any API); returns its text (the image token)."""
    ptype = part.get("type")
    if ptype == "image_url":
        url = part.get("image_url")
        if isinstance(url, dict):
            url = url.get("url")
        return images.add_url(url, where, param)
    if ptype == "input_image":
        if part.get("file_id") is not None and part.get("image_url") is None:
            raise ValueError(f"{where}: input_image with a file_id is not supported "
                             "(send image_url)")
        return images.add_url(part.get("image_url"), where, param)
    source = part.get("source")
    if not isinstance(source, dict):
        raise ValueError(f"{where}.source must be an object")
    stype = source.get("type")
    if stype == "base64":
        data = source.get("data")
        if not isinstance(data, str):
            raise ValueError(f"{where}.source.data must be a base64 string")
        media = source.get("media_type")
        return images.add(ImageSource("base64", data, where,
                                      media if isinstance(media, str) else None, param))
    if stype == "url":
        return images.add_url(source.get("url"), where, param)
    raise ValueError(f"{where}.source.type: unsupported image source {stype!r} "
                     "(base64 or url)")


def _text_of_parts(parts: list[dict[str, Any]], where: str,
                   images: ImageCollector | None = None) -> str:
    texts = []
    for i, part in enumerate(parts):
        ptype = part.get("type")
        if ptype in ("text", "input_text", "output_text"):
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{where}.content[{i}].text must be a string")
            texts.append(text)
        elif ptype in IMAGE_PARTS and images is not None:
            texts.append(image_part(part, f"{where}.content[{i}]", images, "messages"))
        elif ptype in ("image_url", "image", "input_image", "input_audio", "document", "file"):
            raise ValueError(f"{where}.content[{i}]: content type {ptype!r} is not supported "
                             "(text-only model)")
        else:
            raise ValueError(f"{where}.content[{i}]: unknown content part type {ptype!r}")
    return "".join(texts)


def function_arguments(value: str | dict[str, Any], where: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value) if value.strip() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: function arguments are not valid JSON: {e.msg}") from e
    if not isinstance(parsed, dict):
        raise ValueError(f"{where}: function arguments must be a JSON object")
    return parsed


def openai_messages(messages: list[OAIMessage], images: ImageCollector | None = None
                    ) -> list[dict[str, Any]]:
    """``images``: the image collector of a vision-language model, else None (a 400)."""
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
        text = (_text_of_parts(content, where, images) if isinstance(content, list)
                else (content or ""))
        msg: dict[str, Any] = {"role": role, "content": text}
        if m.tool_calls:
            if role != "assistant":
                raise ValueError(f"{where}: only assistant messages may carry tool_calls")
            msg["tool_calls"] = [
                {"id": tc.id or f"call_{i}_{j}", "type": "function",
                 "function": {"name": tc.function.name,
                              "arguments": function_arguments(tc.function.arguments,
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


def check_tool_parameters(params: Any, where: str) -> None:
    """A tool's arguments schema, checked alike in all three APIs: an object schema whose
    ``properties`` are schemas and ``required`` names strings (ValueError naming it)."""
    if not isinstance(params, dict):
        raise ValueError(f"{where} must be a JSON Schema object, got {type(params).__name__}")
    kind = params.get("type")
    if kind is not None and kind != "object":
        raise ValueError(f"{where}.type must be 'object' (a tool's arguments are an object), "
                         f"got {kind!r}")
    props = params.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise ValueError(f"{where}.properties must be an object")
        for name, schema in props.items():
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"{where}.properties.{name} must be a schema (an object)")
    required = params.get("required")
    if required is not None and (not isinstance(required, list)
                                 or not all(isinstance(r, str) for r in required)):
        raise ValueError(f"{where}.required must be a list of property names")


def openai_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" \
                or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not fn["name"]:
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': "
                             "{'name': ..., 'parameters': ...}}")
        if fn.get("parameters") is not None:
            check_tool_parameters(fn["parameters"], f"tools[{i}].function.parameters")
    return tools


def _system_text(system: str | list[dict[str, Any]] | None) -> str | None:
    if system is None:
        return None
    if isinstance(system, str):
        return system
    return _text_of_parts(system, "system")


def _tool_result_text(block: dict[str, Any], where: str,
                      images: ImageCollector | None = None) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return _text_of_parts(content, where, images)
    raise ValueError(f"{where}.content must be a string or a list of text blocks")


def anthropic_messages(messages: list[AnthropicMessage],
                       system: str | list[dict[str, Any]] | None,
                       images: ImageCollector | None = None) -> list[dict[str, Any]]:
    """Anthropic Messages -> template messages (system messages keep their place)."""
    if not messages:
        raise ValueError("messages must not be empty")
    out: list[dict[str, Any]] = []
    sys_text = _system_text(system)
    if sys_text:
        out.append({"role": "system", "content": sys_text})
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role not in ("user", "assistant", "system"):
            raise ValueError(f"{where}.role: unknown role {m.role!r} "
                             "(expected user, assistant or system)")
        if m.role == "system":
            text = m.content if isinstance(m.content, str) else _text_of_parts(m.content, where)
            out.append({"role": "system", "content": text})
            continue
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
                            "content": _tool_result_text(block, bw, images)})
            elif btype in ("thinking", "redacted_thinking"):
                continue  # not replayed into the prompt
            elif btype == "image" and images is not None and m.role == "user":
                texts.append(image_part(block, bw, images, "messages"))
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
    """Client tools in the OpenAI function format; server / built-in tools are left out."""
    out = []
    for i, t in enumerate(tools or ()):
        if t.type not in (None, "custom"):
            continue
        if t.input_schema:
            check_tool_parameters(t.input_schema, f"tools[{i}].input_schema")
        out.append({"type": "function",
                    "function": {"name": t.name, "description": t.description or "",
                                 "parameters": t.input_schema
                                 or {"type": "object", "properties": {}}}})
    return out or None


SYSTEM_NOTE_FORMAT = "<system-message>\n{text}\n</system-message>"


def _note(text: str) -> str:
    return SYSTEM_NOTE_FORMAT.format(text=text)


def place_system_messages(messages: list[dict[str, Any]], mid_system_ok: bool
                          ) -> list[dict[str, Any]]:
    """Leading system messages joined; later ones stay (system turns or user-turn notes)."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages) and messages[i]["role"] == "system":
        if out:
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + messages[i]["content"]}
        else:
            out.append(dict(messages[i]))
        i += 1
    pending: list[str] = []  # notes waiting for the next user turn
    for j in range(i, len(messages)):
        m = messages[j]
        if m["role"] != "system":
            if pending and m["role"] == "user":
                m = {**m, "content": "\n\n".join(pending + [m["content"]])}
                pending = []
            elif pending:
                out.append({"role": "user", "content": "\n\n".join(pending)})
                pending = []
            out.append(m)
            continue
        if mid_system_ok:
            out.append(dict(m))
            continue
        nxt = next((n for n in messages[j + 1:] if n["role"] != "system"), None)
        if nxt is not None and nxt["role"] == "user":
            pending.append(_note(m["content"]))
        elif out and out[-1]["role"] == "user" and not pending:
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + _note(m["content"])}
        else:
            pending.append(_note(m["content"]))
    if pending:
        if out and out[-1]["role"] == "user":
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + "\n\n".join(pending)}
        else:
            out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


TOOLS_FALLBACK_FORMAT = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>"
)


def tools_text(tools: list[dict[str, Any]]) -> str:
    """The fallback tools block (one JSON signature per line, in the client's order)."""
    return TOOLS_FALLBACK_FORMAT.format(
        tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function", {})
    body = json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments", {})},
                      ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def tools_into_system(messages: list[dict[str, Any]], tools: list[dict[str, Any]]
                      ) -> list[dict[str, Any]]:
    """For templates that drop ``tools``: the tools block joins the leading system turn,
    calls become ``<tool_call>`` text, results ``<tool_response>`` text of a user turn."""
    block = tools_text(tools)
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            parts = [m["content"]] if m.get("content") else []
            parts += [_call_text(c) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(parts)})
        elif m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "_tool_results": True})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_tool_results", None)
    if out and out[0]["role"] == "system":
        sys_text = out[0]["content"]
        out[0] = {**out[0], "content": (sys_text + "\n\n" + block) if sys_text else block}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out
