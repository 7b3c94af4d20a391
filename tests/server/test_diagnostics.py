"""Anthropic ``diagnostics`` (beta cache-diagnosis-2026-04-07) on a real tiny engine: one
test per miss reason (system / tools / messages changed, evicted, expired, cold, not
stored, not restorable, previous message not found, unavailable), the wire shape streamed and not,
the request log line, and the comparison's parts as units."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sse_checks
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from real_engine import Clock, make_cache, tiny_engine
from server_helpers import sse_events

from promptcache.blocks.tokens import common_prefix
from promptcache.server import create_app
from promptcache.server.ops.diagnostics import (
    BETA,
    Divergence,
    Fingerprint,
    Turn,
    TurnKey,
    TurnStore,
    locate,
    wants_diagnostics,
)
from promptcache.serving_config import ServerConfig

SYSTEM = "You are a terse assistant who answers questions about caches and blocks."
TOOLS = [{"name": "get_weather", "description": "Get the current weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
HEADERS = {"anthropic-beta": f"claude-code-20250219,{BETA}", "anthropic-version": "2023-06-01",
           "X-Claude-Code-Session-Id": "diag-session"}
USER = "Tell me about the memory of a server please."


def body(user: str = USER, system: str = SYSTEM, tools: Any = None,
         history: list[dict[str, Any]] | None = None, **kw: Any) -> dict[str, Any]:
    msgs = [{"role": "user", "content": user}] + list(history or [])
    out: dict[str, Any] = {"model": "default", "max_tokens": 1, "system": system,
                           "messages": msgs, **kw}
    if tools:
        out["tools"] = tools
    return out


class Served:
    def __init__(self, path: Path, budget: int = 64 * 1024**2, ttl: float | None = None,
                 config: ServerConfig | None = None) -> None:
        self.clock = Clock()
        self.cache = make_cache(budget=budget, ttl_seconds=ttl, clock=self.clock)
        self.engine = tiny_engine(path, self.cache)
        # entered: the app's event loop outlives a request (a pre-render is watched there)
        self.client = TestClient(create_app(self.engine, config or ServerConfig())).__enter__()

    def send(self, b: dict[str, Any], headers: dict[str, str] | None = None) -> dict[str, Any]:
        r = self.client.post("/v1/messages", json=b, headers=headers or HEADERS)
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()
        # the reply's next-turn pre-render (a background prefill) ends before the next
        # request: what the cache holds then does not depend on timing
        assert self.client.app.state.pc_prerender.wait_idle(60)
        return data

    def close(self) -> None:
        self.client.__exit__(None, None, None)
        self.engine.close()


@pytest.fixture
def served(tiny_llama_path: Path) -> Iterator[Served]:
    s = Served(tiny_llama_path, ttl=60.0)
    yield s
    s.close()


def prompt_len(r: dict[str, Any]) -> int:
    u = r["usage"]
    return int(u["input_tokens"] + u["cache_creation_input_tokens"] + u["cache_read_input_tokens"])


def missed(prev: dict[str, Any], cur: dict[str, Any]) -> int:
    """The previous turn's reusable length within this prompt, minus what was read."""
    reachable = min(prompt_len(prev) + prev["usage"]["output_tokens"] - 1, prompt_len(cur) - 1)
    return reachable - int(cur["usage"]["cache_read_input_tokens"])


def reason(r: dict[str, Any]) -> dict[str, Any] | None:
    diag = r["diagnostics"]
    return None if diag is None else diag["cache_miss_reason"]


def test_present_only_when_asked_and_null_without_a_miss(served: Served) -> None:
    plain = served.send(body(), headers={"X-Claude-Code-Session-Id": "other"})
    assert "diagnostics" not in plain
    first = served.send(body())
    assert first["diagnostics"] is None  # no previous turn
    reply = [{"role": "assistant", "content": first["content"]},
             {"role": "user", "content": "And the disk?"}]
    second = served.send(body(history=reply))
    assert second["diagnostics"] is None  # a new turn that appends: nothing lost
    assert second["usage"]["cache_read_input_tokens"] == prompt_len(first)


def test_system_changed(served: Served) -> None:
    first = served.send(body())
    second = served.send(body(system=SYSTEM.replace("caches and blocks", "rivers")))
    assert reason(second) == {"type": "system_changed",
                              "cache_missed_input_tokens": missed(first, second)}
    assert missed(first, second) > 0


def test_tools_changed(served: Served) -> None:
    first = served.send(body(tools=TOOLS))
    tools = [{**TOOLS[0], "description": "Get the forecast for a city"}]
    second = served.send(body(tools=tools))
    assert reason(second) == {"type": "tools_changed",
                              "cache_missed_input_tokens": missed(first, second)}


def test_messages_changed(served: Served) -> None:
    first = served.send(body(history=[{"role": "assistant", "content": "Sure."},
                                      {"role": "user", "content": "The disk?"}]))
    second = served.send(body(user="Tell me about the weather of a server please.",
                              history=[{"role": "assistant", "content": "Sure."},
                                       {"role": "user", "content": "The disk?"}]))
    assert reason(second) == {"type": "messages_changed",
                              "cache_missed_input_tokens": missed(first, second)}


def test_evicted(served: Served) -> None:
    first = served.send(body())
    served.cache.evict()
    second = served.send(body())  # a retry of the same turn
    assert second["usage"]["cache_read_input_tokens"] == 0
    assert reason(second) == {"type": "evicted",
                              "cache_missed_input_tokens": prompt_len(first) - 1}


def test_expired(served: Served) -> None:
    first = served.send(body())
    served.clock.advance(61.0)
    second = served.send(body())
    assert reason(second) == {"type": "expired",
                              "cache_missed_input_tokens": prompt_len(first) - 1}


def test_cold(tiny_llama_path: Path) -> None:
    s = Served(tiny_llama_path)
    try:
        first = s.send(body())
        assert s.cache.delete() > 0  # gone without a trace: the cache never saw it
        second = s.send(body())
        assert reason(second) == {"type": "cold",
                                  "cache_missed_input_tokens": prompt_len(first) - 1}
    finally:
        s.close()


def test_not_stored_for_want_of_budget(tiny_llama_path: Path) -> None:
    s = Served(tiny_llama_path, budget=1)  # nothing fits: every block is dropped
    try:
        first = s.send(body())
        second = s.send(body())
        assert reason(second) == {"type": "not_stored",
                                  "cache_missed_input_tokens": prompt_len(first) - 1}
    finally:
        s.close()


def test_not_restorable(tiny_hybrid_path: Path) -> None:
    """A hybrid (SSM) state restores only at its snapshots: continuing the previous reply
    as an assistant prefill repeats the previous turn's tokens, but the state is only
    restorable at a snapshot (a block end the batched engine stored while decoding), not
    where the repeated part ends inside the next stored block."""
    s = Served(tiny_hybrid_path)
    try:
        first = s.send(body(max_tokens=13))  # prompt 44 + 13: the KV ends at a block end
        tok = s.engine.tokenizer
        out_ids = tok.encode(first["content"][0]["text"], add_special_tokens=False)
        k = next(k for k in range(len(out_ids) - 2, 0, -1)
                 if tok.encode(tok.decode(out_ids[:k]), add_special_tokens=False) == out_ids[:k])
        prefix = tok.decode(out_ids[:k])
        second = s.send(body(history=[{"role": "assistant", "content": prefix}]))
        read = second["usage"]["cache_read_input_tokens"]
        assert 0 < read < prompt_len(second) - 1 and prompt_len(first) < prompt_len(second) - 1
        assert reason(second) == {"type": "not_restorable",
                                  "cache_missed_input_tokens": prompt_len(second) - 1 - read}
    finally:
        s.close()


def test_previous_message_id(served: Served) -> None:
    lost = served.send(body(diagnostics={"previous_message_id": "msg_nope"}))
    assert lost["diagnostics"] == {"cache_miss_reason": {"type": "previous_message_not_found"}}
    # null: opt in on a first turn
    first = served.send(body(diagnostics={"previous_message_id": None}))
    assert first["diagnostics"] is None
    served.send(body(user="Something else entirely, about rivers."))
    # named explicitly, the first turn is the one compared with (not the session's last)
    again = served.send(body(diagnostics={"previous_message_id": first["id"]}))
    assert again["diagnostics"] is None
    # the body field alone asks for diagnostics (no beta header)
    edited = served.send(body(system="Another system prompt about caches.",
                              diagnostics={"previous_message_id": first["id"]}),
                         headers={"X-Claude-Code-Session-Id": "diag-session"})
    assert reason(edited)["type"] == "system_changed"  # type: ignore[index]


def test_unavailable_without_a_cache() -> None:
    client = TestClient(create_app(FakeEngine(use_cache=False), ServerConfig()))
    r = client.post("/v1/messages", json=body(), headers=HEADERS)
    assert r.json()["diagnostics"] == {"cache_miss_reason": {"type": "unavailable"}}


def test_streamed_on_message_start(served: Served) -> None:
    first = served.send(body())
    r = served.client.post("/v1/messages", json=body(system="Changed.", stream=True),
                           headers=HEADERS)
    start = next(d for name, d in sse_events(r.text) if name == "message_start")
    got = start["message"]["diagnostics"]["cache_miss_reason"]
    usage = sse_checks.anthropic_stream(r.text)["usage"]
    assert got["type"] == "system_changed"
    reachable = min(prompt_len(first), prompt_len({"usage": usage}) - 1)
    assert got["cache_missed_input_tokens"] == reachable - usage["cache_read_input_tokens"]


def test_subagents_have_their_own_previous_turn(served: Served) -> None:
    main = {**HEADERS}
    sub = {**HEADERS, "x-claude-code-agent-id": "agent-1",
           "x-claude-code-parent-agent-id": "main"}
    served.send(body(), headers=main)
    served.send(body(user="You are a subagent: list the files."), headers=sub)
    # the main conversation's next turn compares with the main turn, not the subagent's
    r = served.send(body(history=[{"role": "assistant", "content": "apital"},
                                  {"role": "user", "content": "More?"}]), headers=main)
    assert r["diagnostics"] is None


def test_the_request_log_line_names_the_miss(served: Served,
                                             caplog: pytest.LogCaptureFixture) -> None:
    first = served.send(body())
    caplog.set_level(logging.INFO, logger="promptcache.server.replies.runner")
    second = served.send(body(system=SYSTEM.replace("caches and blocks", "rivers")))
    [line] = [r.getMessage() for r in caplog.records if "miss=system_changed" in r.getMessage()]
    n = missed(first, second)
    at = second["usage"]["cache_read_input_tokens"]
    assert f" cache=miss:system_changed miss=system_changed; {n} tokens of the previous turn not reused; " \
           f"diverges at token {at} (message 0, system) in system; " \
           'previous " answers questions about| caches and blocks.<|im_" vs ' \
           'request " answers questions about| rivers.<|im_end|>\\n<|im_"; ' \
           f"cache: diverged: first uncached token at position {at}" in line
    assert "session=diag-session (x-claude-code-session-id)" in line


# --- units ------------------------------------------------------------------------------


def test_wants_diagnostics() -> None:
    assert wants_diagnostics(f"a,{BETA}", None)
    assert wants_diagnostics(f" {BETA} ", None)
    assert wants_diagnostics(None, {"previous_message_id": None})
    assert not wants_diagnostics("claude-code-20250219", None)
    assert not wants_diagnostics(None, None)


@pytest.mark.parametrize("restored, cause, want", [
    (10, "cold", None),
    (12, None, None),
    (4, "evicted", ("evicted", 6)),
    (4, "promotion_failed", ("evicted", 6)),
    (0, "expired", ("expired", 10)),
    (3, "not_restorable", ("not_restorable", 7)),
    (0, None, ("cold", 10)),
    (2, "diverged", ("messages_changed", 8)),
])
def test_diagnose_repeated_prefix(restored: int, cause: str | None,
                                  want: tuple[str, int] | None) -> None:
    div = Divergence(previous=True, reachable=10, position=10)
    got = div.diagnose(restored, cause)
    assert (None if got is None else (got.type, got.missed)) == want


def test_diagnose_changed_and_special() -> None:
    div = Divergence(previous=True, reachable=10, position=4, changed="tools_changed")
    assert div.diagnose(4, "diverged").to_wire() == {  # type: ignore[union-attr]
        "cache_miss_reason": {"type": "tools_changed", "cache_missed_input_tokens": 6}}
    assert div.diagnose(10, "cold") is None
    assert div.diagnose(4, None, caching=False).to_wire() == {  # type: ignore[union-attr]
        "cache_miss_reason": {"type": "unavailable"}}
    assert Divergence(previous=False).diagnose(0, "cold") is None


def test_fingerprint_first_change() -> None:
    tools = [{"type": "function", "function": {"name": "a"}}]
    base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    fp = Fingerprint.of(base, tools)
    assert Fingerprint.of(base, None).first_change(fp) == "tools_changed"
    assert Fingerprint.of([{"role": "system", "content": "t"}, base[1]], tools
                          ).first_change(fp) == "system_changed"
    assert Fingerprint.of(base + [{"role": "user", "content": "v"}], tools
                          ).first_change(fp) == "messages_changed"


def test_common_prefix_and_locate() -> None:
    from array import array
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix(array("I", [1, 2, 3]), [1, 2, 3, 9]) == 3
    assert common_prefix([], [1]) == 0
    texts = [("system", "You are terse."), ("messages[0].content", "Tell me about caches."),
             ("messages[2].content", "Tell me about rivers.")]
    assert locate("Tell me about ", "rivers.<|im_end|>", texts) == "messages[2].content"
    assert locate("<|im_start|>user\n", "Tell me about caches", texts) == "messages[0].content"
    assert locate("<|im_end|>\n", "<|im_start|>", texts) is None


def test_turn_store_bounds() -> None:
    from array import array
    store = TurnStore(max_turns=2, max_tokens=10)
    fp = Fingerprint.of([], None)
    key = TurnKey("t", "s")
    store.add(Turn(key, fp, array("I", [1] * 4)), "m1")
    store.add(Turn(key, fp, array("I", [2] * 4)), "m2")
    assert store.last(key).tokens[0] == 2  # type: ignore[union-attr]
    store.add(Turn(TurnKey("t", "other"), fp, array("I", [3] * 4)), "m3")  # over max_turns
    assert store.by_id("m1", None) is None and len(store) == 2
    store.add(Turn(None, fp, array("I", [4] * 9)), "m4")  # over max_tokens
    assert store.by_id("m2", None) is None and store.last(key) is None
    assert store.by_id("m4", None) is not None


# --- the request log's words and the hit-rate alert -----------------------------------------

ONE_SHOT = {"anthropic-version": "2023-06-01"}  # no session: one-shot questions
QUESTIONS = ["What is a block?", "Name a river in France.", "How far is the moon?",
             "Why is the sky blue?", "Spell cache backwards.", "Is zero even?",
             "Who wrote Hamlet?", "What does RAM stand for?", "Count to three.",
             "What colour is grass?", "Translate hello to French.", "Is a tomato a fruit?"]


def request_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("request ")]


def bare(lines: list[str]) -> list[str]:
    """The request log lines without the request id, the api and the timings."""
    return [re.sub(r" ttft=\S+ decode=\S+ tok/s", "", line.split(" ", 3)[3]) for line in lines]


def test_unrelated_questions_are_new_and_raise_no_alert(
        tiny_llama_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Twelve unrelated one-shot questions share the system prompt and then differ in
    their own message: each is ``new``, none is counted, no alert, no advice."""
    s = Served(tiny_llama_path, config=ServerConfig(hit_rate_window=5))
    try:
        caplog.set_level(logging.INFO)
        for q in QUESTIONS:
            s.send(body(user=q), headers=ONE_SHOT)
        lines = request_lines(caplog)
        assert len(lines) == 12 and all(line.endswith(" cache=new") for line in lines)
        assert "cached=0 (-)" in lines[0] and "cached=0 (-)" not in lines[1]  # the system prompt
        stats = s.client.get("/v1/cache/stats").json()
        assert (stats["rolling"]["requests_in_window"],
                stats["rolling"]["skipped_new_prompts"]) == (0, 12)
        assert stats["alert"]["active"] is False
        assert stats["cache"]["misses_by_cause"]["diverged"] == 11  # what the lookups saw
        assert (stats["diagnosis"]["dominant_cause"], stats["diagnosis"]["summary"]) == (None, None)
        assert not any("low prompt-cache hit rate" in r.getMessage() for r in caplog.records)
    finally:
        s.close()


def test_a_next_turn_is_a_hit_and_evicted_turns_raise_the_alert(
        tiny_llama_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A session's first turn is ``new``, its next turn a hit with its tier; next turns
    whose blocks were evicted are ``miss:evicted``, counted, and raise the alert with
    the eviction advice."""
    s = Served(tiny_llama_path, config=ServerConfig(hit_rate_window=3))
    try:
        caplog.set_level(logging.INFO)
        history: list[dict[str, Any]] = []
        first = s.send(body())
        history += [{"role": "assistant", "content": first["content"]},
                    {"role": "user", "content": "And the disk?"}]
        second = s.send(body(history=history))
        assert second["usage"]["cache_read_input_tokens"] == prompt_len(first)
        for turn in range(3):
            s.cache.evict()
            history += [{"role": "assistant", "content": "Sure."},
                        {"role": "user", "content": f"And turn {turn}?"}]
            s.send(body(history=history))
        session = "tenant=default session=diag-session (x-claude-code-session-id)"
        evicted = ("finish=length cache=miss:evicted miss=evicted; {} tokens of the previous "
                   "turn not reused; cache: evicted: first uncached token at position 0 "
                   "(chat message 0)")
        assert bare(request_lines(caplog)) == [
            f"{session} prompt=44 cached=0 (-) completion=1 finish=length cache=new",
            # the previous turn's live state
            f"{session} prompt=59 cached=44 (live=44) completion=1 finish=length cache=hit:live",
            f"{session} prompt=80 cached=0 (-) completion=1 " + evicted.format(59),
            f"{session} prompt=100 cached=0 (-) completion=1 " + evicted.format(80),
            f"{session} prompt=120 cached=0 (-) completion=1 " + evicted.format(100)]
        stats = s.client.get("/v1/cache/stats").json()
        assert stats["rolling"]["requests_in_window"] == 3
        assert stats["rolling"]["hit_rate"] == 0.0 and stats["alert"]["active"] is True
        assert stats["rolling"]["top_miss_reasons"] == {"evicted": 3}
        assert stats["diagnosis"]["dominant_cause"] == "evicted"
        [warning] = [r.getMessage() for r in caplog.records
                     if "low prompt-cache hit rate" in r.getMessage()]
        # raised once the window held 3 counted requests: the hit (44 of 44) and two
        # evicted turns (0 of 59, 0 of 80)
        assert warning == ("low prompt-cache hit rate: 24.0% of the tokens 3 requests repeat "
                           "from earlier traffic were reused (threshold 80%); most common "
                           "miss reasons: evicted x2; diagnosis: 100% of missed tokens were "
                           "blocks evicted before reuse: a RAM budget of 68 MB would have kept "
                           "them (now 64 MB)")
    finally:
        s.close()
