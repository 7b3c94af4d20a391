"""The summary figures, the Markdown report, JSON and charts, on synthetic results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import report
from harness.runner import bytes_held_from_stats


def _turn(ttft: float, prompt: int, cached: int | None, ok: bool = True, before: str | None = None,
          completion: int = 4) -> dict:
    return {"ok": ok, "ttft_s": ttft if ok else None, "total_s": ttft + 0.1 if ok else None,
            "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": completion,
            "before": before, "error": None if ok else "boom"}


def _floor(prompt: int, cached: int, s: float) -> dict:
    return {"conversation": 0, "index": 0, "prompt_tokens": prompt, "cached_tokens": cached,
            "new_tokens": prompt - cached, "floor_s": s}


def _scenario(measure_bytes: bool = False) -> dict:
    return {
        "title": "t", "measure_bytes": measure_bytes, "kv_bytes_per_token": 1000,
        "floor": [_floor(100, 0, 0.5), _floor(200, 100, 0.25), _floor(300, 200, 0.25)],
        "runs": {
            "ours": {"turns": [_turn(0.5, 100, 0), _turn(0.25, 200, 100), _turn(0.5, 300, 200)],
                     "peak_rss": 3 * 2**20, "disk_bytes": 2**20,
                     "cache_stats": {"tiers": {"ram": {"bytes": 300_000},
                                               "ssd": {"bytes": 312_000}}},
                     "rss_after_warmup": 0, "rss_at_end": 0},
            "mlx_lm": {"turns": [_turn(0.5, 100, 0), _turn(1.0, 200, 100), _turn(1.0, 300, 0)],
                       "peak_rss": 2**20, "disk_bytes": 0,
                       "rss_after_warmup": 10_000, "rss_at_end": 500_000},
            "vllm_mlx": {"turns": [_turn(0.5, 100, None), _turn(0.5, 200, None),
                                   _turn(0.0, 300, None, ok=False)],
                         "peak_rss": 0, "disk_bytes": 0},
            "nocache": {"turns": [_turn(0.5, 100, 0), _turn(1.0, 200, 0), _turn(1.5, 300, 0)],
                        "peak_rss": 0, "disk_bytes": 0},
        },
    }


def test_summarize_exact_figures() -> None:
    s = report.summarize(_scenario())
    ours, mlx, vllm, nocache = s["ours"], s["mlx_lm"], s["vllm_mlx"], s["nocache"]
    assert ours["sum_ttft_s"] == pytest.approx(1.25)
    assert ours["vs_floor"] == pytest.approx(1.25)  # Σ floor = 1.0
    # vllm_mlx failed a turn: incomplete, so mlx_lm (2.5 s) is the best peer
    assert not vllm["complete"] and vllm["failed_turns"] == 1 and vllm["vs_best_peer"] is None
    assert mlx["vs_best_peer"] == pytest.approx(1.0)
    assert ours["vs_best_peer"] == pytest.approx(0.5)
    assert nocache["vs_best_peer"] == pytest.approx(1.2)
    # cached turns are those where the ideal cache holds something: turns 2 and 3
    assert ours["cached_turn_vs_floor_median"] == pytest.approx(1.5)  # ratios 1.0, 2.0
    assert ours["cached_turn_vs_floor_max"] == pytest.approx(2.0)
    assert ours["hit_rate"] == pytest.approx(300 / 600)
    assert mlx["hit_rate"] == pytest.approx(100 / 600)
    assert vllm["hit_rate"] is None  # it never reported cached tokens
    assert ours["target_vs_peer_met"] is True
    assert ours["target_vs_floor_met"] is False


def test_summarize_bytes_held_over_unique_kv() -> None:
    s = report.summarize(_scenario(measure_bytes=True))
    # unique tokens: floor new tokens 100+100+100 plus 3 x 4 generated = 312
    assert s["ours"]["unique_kv_bytes"] == 312_000
    # the largest tier (tiers hold copies of one another under write-through)
    assert s["ours"]["bytes_held"] == 312_000 and s["ours"]["bytes_held_source"] == "cache stats"
    assert s["ours"]["held_vs_unique"] == pytest.approx(1.0)
    assert s["mlx_lm"]["bytes_held"] == 490_000  # RSS growth, no disk
    assert s["mlx_lm"]["bytes_held_source"] == "RSS growth + disk"


def test_bytes_held_from_stats_shapes() -> None:
    assert bytes_held_from_stats({"bytes_held": 5}) == 5
    # the largest tier: under write-through the tiers hold copies of the same blocks
    assert bytes_held_from_stats({"ram_bytes": 5, "ssd_bytes": 7, "other_bytes": 100}) == 7
    assert bytes_held_from_stats({"tiers": {"ram": {"bytes": 1}, "ssd": {"bytes": 2}}}) == 2
    ours = {"cache": {"ram_bytes": 700, "tiers": {"ssd": {"bytes_on_disk": 300, "hits": 2}}},
            "model": "m"}
    assert bytes_held_from_stats(ours) == 700
    assert bytes_held_from_stats({"hits": 3}) is None
    assert bytes_held_from_stats(None) is None


def test_markdown_has_the_command_a_row_per_system_and_the_floor() -> None:
    scn = _scenario()
    results = {"meta": {"model": "/m", "LD_PRELOAD": "/lib/libopenblas.so.0",
                        "OPENBLAS_CORETYPE": "", "cpu_count": 2,
                        "versions": {"mlx": "0.32.4", "mlx-lm": "0.32.2"}},
               "config": {"max_tokens": 16},
               "scenarios": {"S1": {**scn, "skipped": {"x": "not installed"}}}}
    md = report.markdown(results, "promptcache bench --model /m")
    assert "LD_PRELOAD=`/lib/libopenblas.so.0`" in md
    assert "OPENBLAS_CORETYPE=`(unset)`" in md
    assert "promptcache bench --model /m --scenarios S1" in md
    assert "| ours | 1.25 | 0.50× | 1.25× | 1.50× / 2.00× | 50% | 3.0 | 1.0 | 0 |" in md
    assert "| vllm_mlx | 1.00 | — | — | — / — | — | 0 | 0 | 1 |" in md
    assert "| floor | 1.00 | | 1.00× | 1.00× | 50% | | | |" in md
    assert "Σ TTFT ≤ 0.8 × best peer: yes" in md
    assert "cached-turn TTFT ≤ 1.1 × floor (median): **no**" in md
    assert "x: not run (not installed)." in md


def test_json_and_charts_are_written(tmp_path: Path) -> None:
    results = {"meta": {}, "config": {}, "scenarios": {"S4": _scenario()}}
    results["scenarios"]["S4"]["runs"]["ours"]["turns"][1]["before"] = "kill"
    report.write_json(results, tmp_path / "r" / "results.json")
    assert json.loads((tmp_path / "r" / "results.json").read_text()) == results
    paths = report.write_charts(results, tmp_path / "charts")
    assert paths == [tmp_path / "charts" / "s4_ttft.png"]
    data = paths[0].read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert 5_000 < len(data) < 150_000


def test_decode_rate_and_its_table_for_a_scenario_that_measures_decode() -> None:
    turns = [{"ok": True, "completion_tokens": 11, "ttft_s": 0.5, "total_s": 1.5},
             {"ok": True, "completion_tokens": 21, "ttft_s": 0.25, "total_s": 2.25},
             {"ok": False, "completion_tokens": None, "ttft_s": None, "total_s": None}]
    assert report.decode_rate(turns) == (32, 3.0, 10.0)  # (10 + 20) tokens after the first
    assert report.decode_rate(turns[2:]) == (0, None, None)
    results = {"meta": {}, "config": {"max_tokens": 16}, "scenarios": {"E1": {
        "title": "edit", "measure_decode": True, "floor": [], "max_tokens": 160,
        "runs": {"ours_spec": {"system": "ours_spec", "turns": turns[:1], "error": None}}}}}
    md = report.markdown(results)
    assert "| ours_spec | 11 | 1.00 | 10.0 |" in md
    assert "max_tokens 160 in this scenario." in md
