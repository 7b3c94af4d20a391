"""What the server needs to know about a model's chat format, read from mlx-lm's
``TokenizerWrapper`` and the template: thinking markers and switch, and the tool-call format
(``HERMES`` when mlx-lm does not recognise it).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .tool_formats import (
    DEEPSEEK_CALL_BEGIN,
    DEEPSEEK_CALL_END,
    DEEPSEEK_CALLS_BEGIN,
    DEEPSEEK_CALLS_END,
    DEEPSEEK_SEP,
    parse_deepseek,
    parse_glm47,
    parse_qwen3_coder,
)

_ENABLE_THINKING = re.compile(r"\benable_thinking\b")
# templates (e.g. DeepSeek V3.1) that read a bare ``thinking`` variable
_BARE_THINKING = re.compile(r"\bthinking\s+is\s+(?:not\s+)?defined\b|\bif\s+(?:not\s+)?thinking\b")

# mlx-lm's ``parse_tool_call(text, tools)``: dict(s) with "name" and "arguments"; raises otherwise
ToolParser = Callable[[str, Any], Any]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def _as_call(obj: Any) -> ToolCall:
    if not isinstance(obj, Mapping):
        raise ValueError(f"a tool call must be an object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call needs a string 'name'")
    args = obj.get("arguments", obj.get("parameters", {}))
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"tool call arguments are not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise ValueError("tool call arguments must be an object")
    return ToolCall(name=name, arguments=args)


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model writes tool calls: ``start`` + body + ``end`` (``""``: to the reply's end)."""

    # the mlx-lm parser module ("json_tools", "qwen3_coder", ...) or "hermes" (the fallback)
    name: str
    start: str
    end: str
    parser: ToolParser = field(repr=False, compare=False)
    # a reply that is one JSON call object (or a JSON list of them) counts as calls
    bare_json: bool = False
    # ids of the markers when each is one added token (grammars name them)
    start_token: int | None = None
    end_token: int | None = None
    # what a grammar needs from the template (mistral: "args" for ``name[ARGS]{...}``, "json")
    variant: str = ""
    # the format's inner markers (``INNER_MARKERS``) that are one added token: (text, id)
    markers: tuple[tuple[str, int], ...] = ()

    def token_of(self, text: str) -> int | None:
        """The id of marker ``text`` when it is one added token, else None."""
        if text == self.start and self.start_token is not None:
            return self.start_token
        if text == self.end and self.end_token is not None:
            return self.end_token
        return dict(self.markers).get(text)

    def parse(self, body: str, tools: Sequence[Mapping[str, Any]] | None = None
              ) -> tuple[ToolCall, ...]:
        """The calls in ``body`` (between the markers); ValueError when not a complete call."""
        try:
            parsed = self.parser(body, list(tools) if tools else None)
        except Exception as e:  # each mlx-lm parser fails in its own way on non-calls
            raise ValueError(f"not a {self.name} tool call: {type(e).__name__}: {e}") from None
        items = parsed if isinstance(parsed, list) else [parsed]
        if not items:
            raise ValueError("no tool call in the text")
        return tuple(_as_call(item) for item in items)


# formats whose mlx-lm parser loses calls: ours instead (``tool_formats.py``)
OUR_PARSERS: dict[str, ToolParser] = {"qwen3_coder": parse_qwen3_coder,
                                      "glm47": parse_glm47}


def _parser_module(name: str) -> Any:
    if not re.fullmatch(r"[a-z0-9_]+", name):
        raise ValueError(f"invalid tool parser name {name!r}")
    try:
        return importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    except ImportError as e:
        raise ValueError(f"mlx-lm has no tool parser {name!r}") from e


def tool_call_format(name: str, *, start_token: int | None = None,
                     end_token: int | None = None, variant: str = "") -> ToolCallFormat:
    """The format of mlx-lm's tool parser ``name``, or one of ours (``deepseek``)."""
    own = OWN_FORMATS.get(name)
    if own is not None:
        return own
    mod = _parser_module(name)
    return ToolCallFormat(name=name, start=str(mod.tool_call_start), end=str(mod.tool_call_end),
                          parser=OUR_PARSERS.get(name, mod.parse_tool_call),
                          start_token=start_token,
                          end_token=end_token, variant=variant)


HERMES = ToolCallFormat(
    name="hermes", start="<tool_call>", end="</tool_call>",
    parser=_parser_module("json_tools").parse_tool_call, bare_json=True)


# markers inside a call, per format, that the model's vocabulary may hold as added tokens
INNER_MARKERS: dict[str, tuple[str, ...]] = {
    "glm47": ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    "kimi_k2": ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
    "deepseek": (DEEPSEEK_CALL_BEGIN, DEEPSEEK_SEP, DEEPSEEK_CALL_END),
}
HARMONY_MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                   "<|return|>", "<|call|>")


@dataclass(frozen=True)
class ChatFormat:
    think_start: str | None = None
    think_end: str | None = None
    thinking_kwarg: str | None = None
    think_start_token: int | None = None
    think_end_token: int | None = None
    tool_format: ToolCallFormat | None = None
    # gpt-oss's harmony format: parsed by ``server/replies/harmony.py``
    harmony: bool = False
    # harmony markers that are one added token of the model: (text, id)
    harmony_tokens: tuple[tuple[str, int], ...] = ()

    def harmony_token(self, text: str) -> int | None:
        return dict(self.harmony_tokens).get(text)

    @property
    def has_thinking(self) -> bool:
        """The model marks its reasoning (so it can be split from the answer)."""
        return bool(self.think_start) and bool(self.think_end)

    def thinking_kwargs(self, enabled: bool | None) -> dict[str, bool]:
        """Template variables for a request's thinking switch (empty: the template's default)."""
        if enabled is None or self.thinking_kwarg is None:
            return {}
        return {self.thinking_kwarg: bool(enabled)}

    def tools_format(self, template_renders_tools: bool) -> ToolCallFormat:
        """The model's own tool format if the template renders tools and mlx-lm knows it, else
        ``HERMES``."""
        if template_renders_tools and self.tool_format is not None:
            return self.tool_format
        return HERMES


def _template_source(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        return template
    if isinstance(template, dict):  # named templates: {"default": ..., "tool_use": ...}
        return "\n".join(str(v) for v in template.values())
    return ""


def _special_id(tokenizer: Any, ids: Any) -> int | None:
    """The id when ``ids`` is one added token (llguidance treats all added tokens as special)."""
    if not isinstance(ids, (tuple, list)) or len(ids) != 1:
        return None
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if not isinstance(decoder, Mapping):
        return None
    return int(ids[0]) if decoder.get(int(ids[0])) is not None else None


# formats mlx-lm does not know, recognised from the template: ours
DEEPSEEK = ToolCallFormat(name="deepseek", start=DEEPSEEK_CALLS_BEGIN, end=DEEPSEEK_CALLS_END,
                          parser=parse_deepseek)
OWN_FORMATS = {"deepseek": DEEPSEEK}


def _marker_ids(tokenizer: Any, texts: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """(text, id) of each of ``texts`` that is one added token of ``tokenizer``."""
    encode = getattr(tokenizer, "encode", None)
    if not callable(encode):
        return ()
    out = []
    for text in texts:
        try:
            ids = encode(text, add_special_tokens=False)
        except Exception:  # a tokenizer that cannot encode: markers are spelled out
            return ()
        token = _special_id(tokenizer, list(ids) if ids is not None else None)
        if token is not None:
            out.append((text, token))
    return tuple(out)


def _with_markers(fmt: ToolCallFormat, tokenizer: Any) -> ToolCallFormat:
    """``fmt`` with the ids of its markers that are added tokens of ``tokenizer``."""
    inner = INNER_MARKERS.get(fmt.name, ())
    found = dict(_marker_ids(tokenizer, (fmt.start, *((fmt.end,) if fmt.end else ()), *inner)))
    if not found:
        return fmt
    start = fmt.start_token if fmt.start_token is not None else found.get(fmt.start)
    end = fmt.end_token
    if end is None and fmt.end:
        end = found.get(fmt.end)
    return dataclasses.replace(fmt, start_token=start, end_token=end,
                               markers=tuple((m, found[m]) for m in inner if m in found))


def _tool_format_of(tokenizer: Any, source: str) -> ToolCallFormat | None:
    fmt = _detected_format(tokenizer, source)
    return _with_markers(fmt, tokenizer) if fmt is not None else None


def _detected_format(tokenizer: Any, source: str) -> ToolCallFormat | None:
    if DEEPSEEK_CALLS_BEGIN in source:  # DeepSeek V3 / V3.1 (mlx-lm has no parser)
        return DEEPSEEK
    parser = getattr(tokenizer, "tool_parser", None)
    start = getattr(tokenizer, "tool_call_start", None)
    end = getattr(tokenizer, "tool_call_end", None)
    if not callable(parser) or not isinstance(start, str) or not start \
            or not isinstance(end, str):
        return None
    init = getattr(tokenizer, "init_kwargs", None)
    name = init.get("tool_parser_type") if isinstance(init, Mapping) else None
    if not isinstance(name, str) or not name:
        name = str(getattr(parser, "__module__", "")).rsplit(".", 1)[-1] or "unknown"
    variant = ""
    if name == "mistral":
        variant = "args" if "[ARGS]" in source else "json"
    return ToolCallFormat(
        name=name, start=start, end=end, parser=OUR_PARSERS.get(name, parser),
        start_token=_special_id(tokenizer, getattr(tokenizer, "tool_call_start_tokens", None)),
        end_token=_special_id(tokenizer, getattr(tokenizer, "tool_call_end_tokens", None))
        if end else None,
        variant=variant)


def chat_format_of(tokenizer: Any) -> ChatFormat:
    """The chat format of a ``TokenizerWrapper`` (or alike); unknown attributes read as "none"."""
    start = getattr(tokenizer, "think_start", None)
    end = getattr(tokenizer, "think_end", None)
    source = _template_source(tokenizer)
    kwarg: str | None = None
    if _ENABLE_THINKING.search(source):
        kwarg = "enable_thinking"
    elif _BARE_THINKING.search(source):
        kwarg = "thinking"
    has_start = isinstance(start, str) and bool(start)
    has_end = isinstance(end, str) and bool(end)
    harmony = "<|channel|>" in source and "<|message|>" in source
    return ChatFormat(
        think_start=start if has_start else None,
        think_end=end if has_end else None,
        thinking_kwarg=kwarg,
        think_start_token=_special_id(tokenizer, getattr(tokenizer, "think_start_tokens", None))
        if has_start else None,
        think_end_token=_special_id(tokenizer, getattr(tokenizer, "think_end_tokens", None))
        if has_end else None,
        tool_format=_tool_format_of(tokenizer, source),
        harmony=harmony,
        harmony_tokens=_marker_ids(tokenizer, HARMONY_MARKERS) if harmony else (),
    )
