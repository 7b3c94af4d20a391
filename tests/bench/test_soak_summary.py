"""The soak's summary and its Markdown (``harness.soak``), from made-up samples."""

from __future__ import annotations

import pytest

from harness.soak import Sample, markdown, summarize

MB = 2**20


def _sample(i: int, rss_mb: int, threads: int, fds: int, arrays: int) -> Sample:
    return Sample(round=i, t=30.0 * (i + 1), rss=rss_mb * MB, threads=threads, fds=fds,
                  ram_arrays=arrays, live_arrays=2, live_states=1, mlx_active=64 * MB,
                  mlx_cache=8 * MB, requests=8 * (i + 1), errors_5xx=0, refused=i // 3)


def test_the_ranges_are_taken_after_warm_up() -> None:
    samples = [_sample(0, 900, 40, 60, 5), _sample(1, 500, 20, 19, 100),
               _sample(2, 520, 21, 21, 110), _sample(3, 480, 20, 20, 90)]
    s = summarize(samples, warmup=0.25)  # the first of four rounds is warm-up
    assert s["warmup_rounds"] == 1 and s["rounds"] == 4 and s["minutes"] == 2.0
    assert (s["requests"], s["errors_5xx"], s["refused"]) == (32, 0, 1)
    assert s["rss"] == [480 * MB, 520 * MB] and s["rss_spread"] == pytest.approx(0.04)
    assert (s["threads"], s["fds"], s["arrays"]) == ([20, 21], [19, 21], [92, 112])
    assert s["mlx_active"] == [64 * MB, 64 * MB] and s["live_states"] == [1, 1]
    # a warm-up share of everything still leaves the last round
    assert summarize(samples, warmup=1.0)["rss"] == [480 * MB, 480 * MB]
    with pytest.raises(ValueError, match="no samples"):
        summarize([])


def test_markdown_has_a_row_per_system() -> None:
    samples = [_sample(0, 500, 20, 19, 100), _sample(1, 520, 21, 21, 110)]
    runs = {"ours": {"streams": 8, "summary": summarize(samples, warmup=0.0),
                     "hit_tokens_by_tier": {"ram": 1200, "ssd": 34567, "redis": 64}},
            "ours_kv4": {"streams": 8, "summary": summarize(samples, warmup=0.0)},
            "ours_kv8": {"streams": 8, "error": "RuntimeError: boom"}}
    md = markdown(runs, {"nocache": "the soak reads ours' /v1/cache/stats"})
    rows = [line for line in md.splitlines() if line.startswith("| ours") or "nocache" in line]
    assert rows == [
        "| ours | 8 | 2 | 1.00 | 16 | 0 | 0 | 500-520 (±2.0%) | 20-21 | 19-21 | 102-112 "
        "| 64-64 | ram 1,200, ssd 34,567, redis 64 |",
        "| ours_kv4 | 8 | 2 | 1.00 | 16 | 0 | 0 | 500-520 (±2.0%) | 20-21 | 19-21 | 102-112 "
        "| 64-64 | — |",
        "| ours_kv8 | error: RuntimeError: boom |",
        "| nocache | skipped: the soak reads ours' /v1/cache/stats |"]
