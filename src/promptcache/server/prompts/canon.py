"""Canonical prompts: named rules that remove meaningless byte churn before rendering, never
changing what the model is told (docs/api.md; ``--no-canonicalize RULE``). They run in the
preparation thread, but ``billing_header`` also as Anthropic system blocks are parsed."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

BILLING_HEADER = "billing_header"
TOOL_KEYS = "tool_keys"
TOOL_ORDER = "tool_order"

RULES: dict[str, str] = {
    BILLING_HEADER: "drop Claude Code's x-anthropic-billing-header system block "
                    "(per-request metadata)",
    TOOL_KEYS: "render every tool schema with its JSON keys in one canonical order",
    TOOL_ORDER: "offer the tools sorted by name",
}
ALL = "all"

# "x-anthropic-billing-header: cc_version=2.1.197.3bb; cc_entrypoint=sdk-cli; cch=ab12;"
_PAIR = r"\s*[\w.-]+=[^;\n]*"
_HEADER_RE = re.compile(rf"^x-anthropic-billing-header:(?:{_PAIR};)*(?:{_PAIR})?\s*$")


def parse_rules_off(names: Iterable[str]) -> frozenset[str]:
    """The rules named by ``--no-canonicalize`` (``all``: every rule); ValueError if unknown."""
    off: set[str] = set()
    for name in names:
        key = name.strip().lower().replace("-", "_")
        if key == ALL:
            off.update(RULES)
        elif key in RULES:
            off.add(key)
        else:
            raise ValueError(f"unknown canonicalization rule {name!r}; expected one of "
                             f"{', '.join(sorted(RULES))} or {ALL}")
    return frozenset(off)


def is_billing_header(text: str) -> bool:
    """``text`` is exactly one billing-header line (surrounding whitespace aside)."""
    return bool(_HEADER_RE.match(text.strip()))


# the keys of an OpenAI tool, its function and a JSON Schema in the convention's order;
# other keys follow, sorted
STRUCTURE_ORDER = ("type", "function", "name", "title", "description", "parameters",
                   "input_schema", "properties", "items", "enum", "default", "required",
                   "additionalProperties", "strict")
_RANK = {k: i for i, k in enumerate(STRUCTURE_ORDER)}
# JSON Schema keys whose value maps names (of properties, of definitions) to schemas
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})


def canonical_keys(value: Any, *, names: bool = False) -> Any:
    """``value`` with every JSON object's keys in canonical order (``STRUCTURE_ORDER``,
    then sorted; ``names``: a map of names, all sorted); lists keep their order."""
    if isinstance(value, Mapping):
        order = sorted(value, key=str) if names else sorted(
            value, key=lambda k: (_RANK.get(k, len(_RANK)), str(k)))
        return {k: canonical_keys(value[k], names=not names and k in _NAME_MAPS)
                for k in order}
    if isinstance(value, list):
        return [canonical_keys(v) for v in value]
    return value


def _tool_name(tool: Mapping[str, Any]) -> str:
    fn = tool.get("function")
    name = fn.get("name") if isinstance(fn, Mapping) else tool.get("name")
    return name if isinstance(name, str) else ""


@dataclass(frozen=True)
class Canon:
    off: frozenset[str] = frozenset()

    def on(self, rule: str) -> bool:
        return rule not in self.off

    @property
    def active(self) -> tuple[str, ...]:
        return tuple(r for r in RULES if r not in self.off)

    def system_blocks(self, blocks: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Anthropic ``system`` blocks without the billing-header block."""
        if not self.on(BILLING_HEADER):
            return list(blocks)
        return [b for b in blocks
                if not (b.get("type") == "text" and isinstance(b.get("text"), str)
                        and is_billing_header(b["text"]))]

    def system_text(self, text: str) -> str:
        """The text without a leading billing-header line (followed by a newline or alone)."""
        if not self.on(BILLING_HEADER) or not text.startswith("x-anthropic-billing-header:"):
            return text
        first, nl, rest = text.partition("\n")
        if not is_billing_header(first):
            return text
        return rest.lstrip("\n") if nl else ""

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The billing-header line dropped from leading system messages (empty ones go)."""
        if not self.on(BILLING_HEADER):
            return messages
        out: list[dict[str, Any]] = []
        for i, m in enumerate(messages):
            content = m.get("content")
            if m.get("role") == "system" and isinstance(content, str) \
                    and all(p.get("role") == "system" for p in messages[:i]):
                text = self.system_text(content)
                if text != content:
                    if text:
                        out.append({**m, "content": text})
                    continue
            out.append(m)
        return out

    def tools(self, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if not tools:
            return tools
        out = [canonical_keys(t) for t in tools] if self.on(TOOL_KEYS) else list(tools)
        if self.on(TOOL_ORDER):
            out.sort(key=_tool_name)
        return out
