"""The bench scenarios are deterministic and have the shapes the issue asks for."""

from __future__ import annotations

import ast
import hashlib
import json
import re

import pytest

from harness import scenarios
from harness.scenarios import THINK_CLOSE, THINK_OPEN, Scenario


def _digest(s: Scenario) -> str:
    rows = [[t.conversation, t.index, t.before, list(t.messages), list(t.tools)] for t in s.turns]
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]


# Pinned: a changed digest means every earlier result is no longer comparable.
GOLDEN_QUICK = {
    "S1": "f9266eb933a145df",
    "S2": "66992381e01c8d70",
    "S3": "3a1ca577d716ca76",
    "S4": "be4fb4aa474244dc",
    "S5": "3f938b6ebfc60752",
    "E1": "4fe6557c6974a861",
}


@pytest.mark.parametrize("name", scenarios.SCENARIO_NAMES)
def test_quick_scenarios_match_their_golden_digest(name: str) -> None:
    assert _digest(scenarios.build(name, quick=True)) == GOLDEN_QUICK[name]


@pytest.mark.parametrize("name", scenarios.SCENARIO_NAMES)
def test_same_seed_same_requests_other_seed_other_text(name: str) -> None:
    a = scenarios.build(name, quick=True, seed=3)
    b = scenarios.build(name.lower(), quick=True, seed=3)
    c = scenarios.build(name, quick=True, seed=4)
    assert a == b
    assert _digest(a) != _digest(c)
    assert [(t.conversation, t.index, t.before) for t in a.turns] == [
        (t.conversation, t.index, t.before) for t in c.turns]


def test_s1_is_a_ten_turn_chat_with_growing_history() -> None:
    s = scenarios.build("S1")
    assert s.api == "openai"
    assert [(t.conversation, t.index) for t in s.turns] == [(0, k) for k in range(10)]
    assert [len(t.messages) for t in s.turns] == [2 + 2 * k for k in range(10)]
    for prev, cur in zip(s.turns, s.turns[1:], strict=False):
        assert cur.messages[: len(prev.messages)] == prev.messages  # pure append
    roles = [m["role"] for m in s.turns[-1].messages]
    assert roles == ["system"] + ["user", "assistant"] * 9 + ["user"]
    # ~350 new tokens per turn: a 270-token user message (241 words at 1.12 tokens per word)
    # after the previous ~80-token reply
    assert len(s.turns[3].messages[-1]["content"].split()) == 241
    assert s.title == "10-turn chat (~350 new tokens per turn)"


def test_s2_agentic_trace_drops_earlier_reasoning() -> None:
    s = scenarios.build("S2")
    assert s.api == "anthropic"
    assert len(s.turns) == 8
    assert all(len(t.tools) == 8 for t in s.turns)
    assert [len(t.messages) for t in s.turns] == [2 + 2 * k for k in range(8)]
    last = s.turns[-1].messages
    assistants = [m for m in last if m["role"] == "assistant"]
    assert len(assistants) == 7
    assert [THINK_OPEN in m["content"] and THINK_CLOSE in m["content"] for m in assistants] == (
        [False] * 6 + [True])
    for m in assistants:
        (call,) = m["tool_calls"]
        assert json.loads(call["function"]["arguments"])["path"].startswith("src/")
    tools = [m for m in last if m["role"] == "tool"]
    assert [t["tool_call_id"] for t in tools] == [m["tool_calls"][0]["id"] for m in assistants]
    # the reasoning kept in turn k is dropped from turn k+1: the histories diverge there
    t3, t4 = s.turns[3].messages, s.turns[4].messages
    assert t3[:6] == t4[:6]
    assert t3[6]["content"] != t4[6]["content"]
    assert t4[6]["content"].endswith(t3[6]["content"].split(THINK_CLOSE + "\n", 1)[1])


def test_s3_interleaves_twenty_conversations_round_robin() -> None:
    s = scenarios.build("S3")
    assert s.num_conversations == 20
    assert s.ram_budget_fraction == 0.25
    assert [(t.conversation, t.index) for t in s.turns] == [
        (c, k) for k in range(3) for c in range(20)]
    systems = {t.messages[0]["content"] for t in s.turns}
    assert len(systems) == 20  # no shared prefix beyond the template


def test_s4_restarts_then_kills_between_turns() -> None:
    full = scenarios.build("S4")
    assert [t.before for t in full.turns] == [None, None, "restart", None, "kill", None]
    quick = scenarios.build("S4", quick=True)
    assert [t.before for t in quick.turns] == [None, "restart", "kill", None]


def test_s5_hundred_conversations_share_one_system_prompt() -> None:
    s = scenarios.build("S5")
    assert s.measure_bytes
    assert [(t.conversation, t.index) for t in s.turns] == [(c, 0) for c in range(100)]
    assert len({t.messages[0]["content"] for t in s.turns}) == 1
    assert len({t.messages[1]["content"] for t in s.turns}) == 100
    assert len(s.turns[0].messages[0]["content"].split()) >= 1500  # ~2k tokens


def test_quick_is_smaller_than_full() -> None:
    for name in scenarios.SCENARIO_NAMES:
        q, f = scenarios.build(name, quick=True), scenarios.build(name)
        size = lambda s: sum(len(json.dumps(t.messages)) for t in s.turns)  # noqa: E731
        assert size(q) < size(f) / 4, name


def test_e1_asks_for_a_file_back_with_one_identifier_renamed() -> None:
    s = scenarios.build("E1", quick=True)
    assert (s.api, s.max_tokens, s.measure_decode, s.num_conversations) == \
        ("openai", 160, True, 1)
    (turn,) = s.turns
    assert [m["role"] for m in turn.messages] == ["system", "user"]
    user = turn.messages[1]["content"]
    old, new = re.findall(r"`(\w+)`", user.split("\n", 1)[0])
    assert old.endswith("_state") and new.endswith("_record")
    code = user.split("```python\n", 1)[1].rsplit("```", 1)[0]
    tree = ast.parse(code)  # a real Python file
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert len(functions) == 6 and len({f.name for f in functions}) == 6
    assert all(f.args.args[0].arg == old for f in functions)
    assert new not in code and code.count(old) >= 2 * 6
    assert len(scenarios.build("E1").turns) == 1
    assert len([n for n in ast.parse(scenarios.build("E1").turns[0].messages[1]["content"]
                                     .split("```python\n", 1)[1].rsplit("```", 1)[0]).body
                if isinstance(n, ast.FunctionDef)]) == 32


def test_e1_requests_are_byte_identical_for_the_same_seed() -> None:
    def body(seed: int) -> bytes:
        (turn,) = scenarios.build("E1", quick=True, seed=seed).turns
        return json.dumps(list(turn.messages), sort_keys=True).encode()

    assert body(5) == body(5)
    assert body(5) != body(6)
    # E1 has its own seed stream: adding it changed no other scenario (golden digests)
    assert scenarios.parse_names("e1,S1") == ["E1", "S1"]


def test_names_are_validated() -> None:
    assert scenarios.parse_names("s1, S3,S1") == ["S1", "S3"]
    with pytest.raises(ValueError, match="unknown scenario 'S9'"):
        scenarios.parse_names("S1,S9")
    with pytest.raises(ValueError, match="no scenario"):
        scenarios.parse_names(" , ")
    with pytest.raises(ValueError, match="unknown scenario"):
        scenarios.build("S0")
