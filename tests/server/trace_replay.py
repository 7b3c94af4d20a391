"""Replays a hit-rate trace (``tests/fixtures/traces/*.json``) through a server as its
client would, and measures the share of each previous turn that was reused.

For every turn the request is the trace's base with the turn laid over it; ``$reply``
markers become the server's earlier replies as that API's client sends them back
(Anthropic content blocks with thinking and tool_use; a chat assistant message with
``tool_calls``; Responses output items) and ``$tool_result`` markers the result of a
reply's first tool call. Requests stream, as the real clients do.

The measure, per turn that continues an earlier one: ``reusable`` = the tokens of this
prompt that carry the previous turn (its prompt and its reply as sent back): the request
is cut right after that reply and given a placeholder next user message, twice with two
different texts; both are rendered by ``/v1/cache/probe?tokens=true`` (a server with the
same model and canonicalization) and ``reusable`` is where the two part, as the chat
template itself places the next message. ``share`` = min(cached, reusable) / reusable;
a trace's share sums over its turns.

``post(path, headers, body) -> (status, text)`` sends a request to the system under
test; ``probe(api, headers, body) -> prompt tokens`` renders one; ``settle()`` runs
between turns (a client's think time: background pre-renders finish there).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sse_checks

from promptcache.blocks.tokens import common_prefix

TRACES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
PATHS = {"messages": "/v1/messages", "chat": "/v1/chat/completions",
         "responses": "/v1/responses"}

Post = Callable[[str, dict[str, str], dict[str, Any]], tuple[int, str]]
# (api, headers, body) -> the rendered token ids (``/v1/cache/probe?tokens=true``)
Probe = Callable[[str, dict[str, str], dict[str, Any]], list[int]]


def load_trace(name: str) -> dict[str, Any]:
    trace: dict[str, Any] = json.loads((TRACES / f"{name}.json").read_text())
    return trace


def trace_names() -> list[str]:
    return sorted(p.stem for p in TRACES.glob("*.json"))


@dataclass
class Reply:
    """What the client keeps of a reply: the echo and the first tool call's id."""

    echo: list[dict[str, Any]]
    call_id: str | None
    prompt_tokens: int
    cached_tokens: int


@dataclass
class TurnReport:
    index: int
    agent: str
    prompt_tokens: int
    cached_tokens: int
    reusable: int | None  # None: a first turn (nothing earlier to reuse)

    @property
    def share(self) -> float | None:
        if not self.reusable:
            return None
        return min(self.cached_tokens, self.reusable) / self.reusable


@dataclass
class TraceReport:
    name: str
    turns: list[TurnReport] = field(default_factory=list)

    @property
    def share(self) -> float:
        turns = [t for t in self.turns if t.reusable]
        total = sum(t.reusable or 0 for t in turns)
        got = sum(min(t.cached_tokens, t.reusable or 0) for t in turns)
        return got / total if total else 1.0

    @property
    def min_share(self) -> float:
        shares = [t.share for t in self.turns if t.share is not None]
        return min(shares) if shares else 1.0

    def table(self) -> str:
        rows = [f"{self.name}: share {self.share:.1%} (min {self.min_share:.1%})"]
        for t in self.turns:
            share = "-" if t.share is None else f"{t.share:.1%}"
            rows.append(f"  turn {t.index} {t.agent}: prompt {t.prompt_tokens} cached "
                        f"{t.cached_tokens} reusable {t.reusable} share {share}")
        return "\n".join(rows)


def _echo(api: str, text: str) -> Reply:
    if api == "messages":
        got = sse_checks.anthropic_stream(text)
        u = got["usage"]
        calls = [b["id"] for b in got["content"] if b["type"] == "tool_use"]
        prompt = u["input_tokens"] + u["cache_creation_input_tokens"] + u["cache_read_input_tokens"]
        return Reply([{"role": "assistant", "content": got["content"]}],
                     calls[0] if calls else None, prompt, u["cache_read_input_tokens"])
    if api == "chat":
        got = sse_checks.chat_stream(text)
        msg: dict[str, Any] = {"role": "assistant", "content": got["content"] or None}
        if got["tool_calls"]:
            msg["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for c in got["tool_calls"]]
        u = got["usage"]
        return Reply([msg], got["tool_calls"][0]["id"] if got["tool_calls"] else None,
                     u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"])
    final = sse_checks.responses_stream(text)
    calls = [o["call_id"] for o in final["output"] if o["type"] == "function_call"]
    u = final["usage"]
    return Reply(list(final["output"]), calls[0] if calls else None,
                 u["input_tokens"], u["input_tokens_details"]["cached_tokens"])


def _tool_result(api: str, reply: Reply, content: str) -> dict[str, Any]:
    if reply.call_id is None:
        raise AssertionError("a $tool_result for a reply without a tool call")
    if api == "messages":
        return {"type": "tool_result", "tool_use_id": reply.call_id, "content": content}
    if api == "chat":
        return {"role": "tool", "tool_call_id": reply.call_id, "content": content}
    return {"type": "function_call_output", "call_id": reply.call_id, "output": content}


def _fill(value: Any, api: str, replies: dict[int, Reply]) -> Any:
    """Markers -> replies (a ``$reply`` in a list is spliced in: Responses items)."""
    if isinstance(value, list):
        out: list[Any] = []
        for item in value:
            if isinstance(item, dict) and "$reply" in item:
                out.extend(copy.deepcopy(replies[item["$reply"]].echo))
            else:
                out.append(_fill(item, api, replies))
        return out
    if isinstance(value, dict):
        if "$tool_result" in value:
            return _tool_result(api, replies[value["$tool_result"]], value["content"])
        return {k: _fill(v, api, replies) for k, v in value.items()}
    return value


def _list_key(api: str) -> str:
    return "input" if api == "responses" else "messages"


PLACEHOLDERS = ("Alpha (the next message)", "Zulu (the next message)")


def _cut_after_last_reply(body: dict[str, Any], api: str, placeholder: str
                          ) -> dict[str, Any] | None:
    """The body cut right after its last ``$reply``, with a placeholder user message."""
    key = _list_key(api)
    items = body.get(key)
    if not isinstance(items, list):
        return None
    last = max((i for i, m in enumerate(items) if isinstance(m, dict) and "$reply" in m),
               default=None)
    if last is None:
        return None
    return {**body, key: items[:last + 1] + [{"role": "user", "content": placeholder}],
            "stream": False}


def trim(value: Any, limit: int) -> Any:
    """Every string of a trace cut to ``limit`` characters (a smaller trace of the same
    shape, for the test suite)."""
    if isinstance(value, str):
        return value[:limit]
    if isinstance(value, list):
        return [trim(v, limit) for v in value]
    if isinstance(value, dict):
        return {k: (v if k.startswith("$") or k in ("role", "type", "name") else trim(v, limit))
                for k, v in value.items()}
    return value


def replay(trace: dict[str, Any], post: Post, probe: Probe,
           settle: Callable[[], None] = lambda: None) -> TraceReport:
    api = trace["api"]
    path = PATHS[api]
    report = TraceReport(trace["name"])
    replies: dict[int, Reply] = {}
    base_headers = trace["base"]["headers"]
    for i, turn in enumerate(trace["turns"]):
        headers = {**base_headers, **turn["headers"]}
        raw = {**trace["base"]["body"], **turn["body"]}
        reusable = None
        cuts = [_cut_after_last_reply(raw, api, p) for p in PLACEHOLDERS]
        if cuts[0] is not None and cuts[1] is not None:
            # where two placeholder next messages part: the end of the earlier turns
            a, b = (probe(api, headers, _fill(c, api, replies)) for c in cuts)
            reusable = common_prefix(a, b)
        status, text = post(path, headers, _fill(raw, api, replies))
        if status != 200:
            raise AssertionError(f"{trace['name']} turn {i}: HTTP {status}: {text[:500]}")
        reply = _echo(api, text)
        replies[i] = reply
        report.turns.append(TurnReport(i, turn["agent"], reply.prompt_tokens,
                                       reply.cached_tokens, reusable))
        settle()
    return report


def model_path(kind: str, models_root: Path) -> Path:
    """The folder of a trace's model (``scripted``, ``thinking``, ``toolcall``)."""
    from models.tiny_models import ensure_tiny_model
    from models.trace_models import ensure_trace_model

    scripted = ensure_tiny_model("scripted", models_root)
    return scripted if kind == "scripted" else ensure_trace_model(kind, scripted, models_root)
