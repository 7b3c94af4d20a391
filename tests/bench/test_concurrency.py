"""The concurrent scenarios C1 / C2: deterministic plans and their metrics (no server)."""

from __future__ import annotations

import pytest

from promptcache.bench import concurrency
from promptcache.bench.client import TurnResult


def test_plans_are_deterministic_and_shaped_as_described():
    c1 = concurrency.build("C1")
    assert c1.labels == ("1", "4", "8", "16")
    assert [len(r) for r in c1.rounds] == [1, 4, 8, 16]
    prompts = [job.messages[1]["content"] for rnd in c1.rounds for (job,) in rnd]
    assert len(set(prompts)) == len(prompts)  # every stream has its own prompt
    assert concurrency.build("c1") == c1
    c2 = concurrency.build("C2")
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
        concurrency.build("C9")


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
