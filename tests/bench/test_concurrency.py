"""The concurrent scenarios C1 / C2: deterministic plans and their metrics (no server)."""

from __future__ import annotations

import json
import re

import pytest

from harness import concurrency, concurrent_plans
from harness.client import TurnResult


def test_plans_are_deterministic_and_shaped_as_described():
    c1 = concurrent_plans.build("C1")
    assert c1.labels == ("1", "4", "8", "16")
    assert [len(r) for r in c1.rounds] == [1, 4, 8, 16]
    prompts = [job.messages[1]["content"] for rnd in c1.rounds for (job,) in rnd]
    assert len(set(prompts)) == len(prompts)  # every stream has its own prompt
    assert concurrent_plans.build("c1") == c1
    c2 = concurrent_plans.build("C2")
    (convs,) = c2.rounds
    assert len(convs) == 4 and all(len(turns) == 3 for turns in convs)
    systems = {turns[0].messages[0]["content"] for turns in convs}
    assert len(systems) == 1 and all(turns[0].tools == convs[0][0].tools for turns in convs)
    assert len(convs[0][0].tools) == 6
    # each turn extends the previous one of its conversation
    for turns in convs:
        for a, b in zip(turns, turns[1:], strict=False):
            assert b.messages[: len(a.messages)] == a.messages
    with pytest.raises(ValueError, match="unknown concurrent scenario"):
        concurrent_plans.build("C9")


def _row(stream, start, ttft, total, completion, prompt=100, cached=0):
    return concurrency.Timed(stream, 0, start, TurnResult(
        ok=True, ttft_s=ttft, total_s=total, prompt_tokens=prompt, cached_tokens=cached,
        completion_tokens=completion))


def test_round_metrics():
    rows = [_row(0, 10.0, 1.0, 5.0, 41, cached=50), _row(1, 10.0, 3.0, 7.0, 21, cached=0),
            concurrency.Timed(2, 0, 10.0, TurnResult(ok=False, error="HTTP 429: busy"))]
    s = concurrency.summarize_round(rows)
    assert (s["requests"], s["ok"], s["completion_tokens"]) == (3, 2, 62)
    assert s["throughput_tps"] == pytest.approx(62 / 7.0)  # first send 10.0, last end 17.0
    assert s["aggregate_decode_tps"] == pytest.approx((40 + 20) / (17.0 - 11.0))
    assert s["per_stream_decode_tps"] == pytest.approx((10.0 + 5.0) / 2)
    assert s["ttft_p50_s"] == pytest.approx(2.0) and s["ttft_p95_s"] == pytest.approx(2.9)
    assert s["sum_ttft_s"] == pytest.approx(4.0) and s["hit_rate"] == pytest.approx(0.25)
    assert s["errors"] == ["HTTP 429: busy"]
    md = concurrency.markdown("C1", "t", {"ours": {"rounds": {"2": {"summary": s}}},
                                          "mlx_lm": {"rounds": {"2": {"summary": s}}}})
    assert "| 2 | ours | 8.9 | 10.0 | 7.5 | 2.00 s | 2.90 s | 2/3 | 1.00× |" in md


@pytest.mark.parametrize("quick", [False, True])
def test_speculation_plans_at_1_and_8_streams(quick):
    for name in ("E2", "E3", "E4"):
        plan = concurrent_plans.build(name, quick=quick)
        assert plan == concurrent_plans.build(name.lower(), quick=quick)
        assert plan.labels == (("1", "2") if quick else ("1", "8"))
        assert plan.max_tokens == (32 if quick else 160)
        one, many = plan.rounds
        assert many[: len(one)] == one  # the same texts, more of them at once
        firsts = [jobs[0].messages[-1]["content"] for jobs in many]
        assert len(set(firsts)) == len(firsts) or name == "E3"  # every stream its own text
        assert concurrent_plans.build(name, streams=[1, 4]).labels == ("1", "4")
    edit = concurrent_plans.build("E2").rounds[1][0][0].messages[1]["content"]
    assert "renamed to" in edit and "```python" in edit
    # E3: read a file, write it back changed (a tool call), report on a test run that
    # quotes the written file: each reply has earlier tool output to copy
    (read, report), *_ = concurrent_plans.build("E3").rounds[1]
    assert read.tools and report.messages[: len(read.messages)] == read.messages
    code = read.messages[-1]["content"]
    assert read.messages[-1]["role"] == "tool" and "def " in code
    calls = [m["tool_calls"][0]["function"] for m in report.messages if m.get("tool_calls")]
    assert [c["name"] for c in calls] == ["read_file", "write_file", "run_tests"]
    written = json.loads(calls[1]["arguments"])["content"]
    assert written != code and len(written.splitlines()) == len(code.splitlines())
    quoted = [line for line in written.splitlines() if line.strip() and line in report.messages[
        -1]["content"]]
    assert len(quoted) >= 3  # the test run's output quotes the lines it wrote
    chats = [jobs[0].messages[1]["content"] for jobs in concurrent_plans.build("E4").rounds[1]]
    assert len(set(chats)) == 8


def test_speculation_counters_over_a_round_and_their_table():
    before = {"engine": {"spec_verifies": 10, "spec_drafted": 40, "spec_accepted": 20,
                         "decode_steps": 100}}
    after = {"engine": {"spec_verifies": 30, "spec_drafted": 120, "spec_accepted": 80,
                        "decode_steps": 150, "spec_paused": 2}}
    d = concurrency.spec_delta(before, after)
    assert d is not None
    assert (d["spec_verifies"], d["spec_drafted"], d["spec_accepted"]) == (20, 80, 60)
    assert (d["decode_steps"], d["spec_paused"]) == (50, 2)
    assert d["acceptance_rate"] == pytest.approx(0.75)
    assert d["mean_accepted"] == pytest.approx(3.0)
    assert d["tokens_per_forward"] == pytest.approx(4.0)
    assert concurrency.spec_delta(None, after) is None
    none = concurrency.spec_delta(after, after)
    assert none is not None and none["acceptance_rate"] is None
    rows = [_row(0, 10.0, 1.0, 5.0, 41), _row(1, 10.0, 3.0, 7.0, 21)]
    s = concurrency.summarize_round(rows)
    fast = {**s, "aggregate_decode_tps": 2 * s["aggregate_decode_tps"], "spec": d}
    md = concurrency.markdown("E2", "t", {
        "mlx_lm": {"rounds": {"8": {"summary": s}}},
        "ours_nospec": {"rounds": {"8": {"summary": {**s, "spec": none}}}},
        "ours": {"rounds": {"8": {"summary": fast}}}})
    # speculation is on by default: "vs no spec" is against ours --speculation off
    assert "vs mlx_lm | vs no spec |" in md
    assert "| 8 | ours | 20.0 | 7.5 | 2.00× | 2.00× | 75.0% | 3.00 | 4.00 | 2/2 |" in md
    assert "| 8 | ours_nospec | 10.0 | 7.5 | 1.00× | 1.00× | — | — | — | 2/2 |" in md


@pytest.mark.parametrize("quick", [False, True])
def test_the_edits_next_turn_plan(quick):
    plan = concurrent_plans.build("E5", quick=quick)
    n = 2 if quick else 8
    assert plan.labels == ("1 turn 1", "1 turn 2", f"{n} turn 1", f"{n} turn 2")
    assert [len(r) for r in plan.rounds] == [1, 1, n, n]
    assert plan.max_tokens == (32 if quick else 160)
    for first, second in ((plan.rounds[0], plan.rounds[1]), (plan.rounds[2], plan.rounds[3])):
        for (t1,), (t2,) in zip(first, second, strict=True):
            assert (t1.index, t2.index) == (0, 1) and t1.stream == t2.stream
            a, b = t1.messages[-1]["content"], t2.messages[-1]["content"]
            file_a, ask_a = a.split("```\n\n")
            file_b, ask_b = b.split("```\n\n")
            assert file_a == file_b and "def " in file_a  # the same file first ...
            old_a, new_a = re.search(r"`(\w+)` renamed to `(\w+)`", ask_a).groups()
            old_b, new_b = re.search(r"`(\w+)` renamed to `(\w+)`", ask_b).groups()
            assert old_a == old_b and new_a != new_b and old_a in file_a  # ... another name
    texts = [jobs[0].messages[-1]["content"] for r in (plan.rounds[0], plan.rounds[2])
             for jobs in r]
    assert len(set(texts)) == len(texts)  # no stream shares its text with another count
