"""Anthropic reply bodies: usage with cache creation split by ttl, stop reason, content blocks."""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

from ...engine.api import GenerationResult
from ..replies.runner import cache_creation_tokens
from ..replies.toolcalls import ToolCall

TTLS = {"5m": 300.0, "1h": 3600.0}
_TTL_KEYS = {300.0: "ephemeral_5m_input_tokens", 3600.0: "ephemeral_1h_input_tokens"}


def creation(prompt_len: int, cached: int, breakpoints: tuple[tuple[int, float], ...]
             ) -> tuple[int, dict[str, int]]:
    """``cache_creation_input_tokens`` and its split by ttl: the tokens after the cached
    ones up to the last breakpoint (none: the end), each under the ttl of the first
    breakpoint at or after it."""
    split = {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}
    marks = breakpoints or ((prompt_len, TTLS["5m"]),)
    start = cached
    for pos, ttl in marks:
        end = min(pos, prompt_len)
        if end > start:
            split[_TTL_KEYS.get(ttl, "ephemeral_5m_input_tokens")] += end - start
            start = end
    return sum(split.values()), split


def anthropic_usage(result: GenerationResult,
                    breakpoints: tuple[tuple[int, float], ...] = ()) -> dict[str, Any]:
    u = result.usage
    created, split = 0, {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}
    if cache_creation_tokens(result):  # the request stored prompt blocks
        created, split = creation(u.prompt_tokens, u.cached_tokens, breakpoints)
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens - created,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation": split,
        "output_tokens": u.completion_tokens,
    }


def stop_fields(result: GenerationResult, calls: tuple[ToolCall, ...] = ()) -> dict[str, Any]:
    if calls:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if result.finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if result.stop_sequence is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": result.stop_sequence}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call.name,
            "input": call.arguments}


def signature(thinking: str) -> str:
    """An opaque signature for a thinking block (clients send blocks back with it)."""
    return "promptcache-" + hashlib.sha256(thinking.encode("utf-8")).hexdigest()[:32]


def content_blocks(reasoning: str, text: str, calls: tuple[ToolCall, ...]
                   ) -> list[dict[str, Any]]:
    """[thinking?, text?, tool_use...]; an empty text block is left out beside the others."""
    blocks: list[dict[str, Any]] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning,
                       "signature": signature(reasoning)})
    if text or not (calls or reasoning):
        blocks.append({"type": "text", "text": text})
    blocks.extend(tool_use_block(c) for c in calls)
    return blocks
