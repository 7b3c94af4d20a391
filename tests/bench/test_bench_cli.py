"""`promptcache bench --quick` end to end against mlx_lm.server on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from promptcache.cli import main


def test_bench_quick_s1_against_mlx_lm(tiny_llama_path: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc = main(["bench", "--quick", "--scenarios", "S1", "--systems", "mlx_lm",
               "--model", str(tiny_llama_path), "--out", str(out), "--max-tokens", "4",
               "--floor-repeats", "1"])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    s1 = results["scenarios"]["S1"]
    run = s1["runs"]["mlx_lm"]
    assert run["error"] is None
    assert [(t["conversation"], t["index"], t["ok"]) for t in run["turns"]] == [
        (0, 0, True), (0, 1, True), (0, 2, True)]
    # greedy, 4 tokens; the server renders the same template as the floor
    assert [t["completion_tokens"] for t in run["turns"]] == [4, 4, 4]
    assert [t["prompt_tokens"] for t in run["turns"]] == [f["prompt_tokens"] for f in s1["floor"]]
    # turn 2 and 3 hit the previous prompt in mlx_lm's LRUPromptCache
    assert all(t["cached_tokens"] > 0 for t in run["turns"][1:])
    assert run["peak_rss"] > 10 * 2**20 and len(run["startup_s"]) == 1
    assert s1["summary"]["mlx_lm"]["complete"] is True
    assert (out / "charts" / "s1_ttft.png").stat().st_size > 5_000
    md = (out / "report.md").read_text()
    assert "| mlx_lm | " in md and "--scenarios S1" in md
    assert "### S1: 3-turn chat" in capsys.readouterr().out
    assert main(["bench", "--model", str(tmp_path), "--out", str(out)]) == 2
    assert "no config.json there" in capsys.readouterr().err


def test_max_tokens_the_flag_then_the_scenarios_own_then_the_default() -> None:
    import argparse

    from harness import scenarios
    from harness.command import DEFAULT_MAX_TOKENS, max_tokens_for

    e1, s1 = scenarios.build("E1", quick=True), scenarios.build("S1", quick=True)
    given, not_given = argparse.Namespace(max_tokens=7), argparse.Namespace(max_tokens=None)
    assert [max_tokens_for(given, e1), max_tokens_for(given, s1), max_tokens_for(given)] == [7] * 3
    assert [max_tokens_for(not_given, e1), max_tokens_for(not_given, s1),
            max_tokens_for(not_given)] == [160, DEFAULT_MAX_TOKENS, DEFAULT_MAX_TOKENS]


def test_the_launcher_finds_the_checkouts_harness(monkeypatch: pytest.MonkeyPatch) -> None:
    from promptcache.cli import bench_cmd

    monkeypatch.delenv(bench_cmd.BENCH_DIR_ENV, raising=False)
    assert bench_cmd.bench_dir() == Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("argv", [[], ["--quick", "--scenarios", "S1"], ["--help"]])
def test_without_a_checkout_bench_says_so_in_one_line(
        argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from promptcache.cli import bench_cmd

    monkeypatch.setenv(bench_cmd.BENCH_DIR_ENV, str(tmp_path))  # no harness/ there
    assert bench_cmd.bench_dir() is None
    assert main(["bench", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == bench_cmd.MISSING + "\n"
    assert captured.err.startswith("promptcache bench needs a source checkout")


def test_the_soak_is_a_listed_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "soak (agent sessions with churn for --minutes" in out
    for flag in ("--minutes", "--rounds", "--soak-streams", "--soak-ram-budget", "--soak-redis"):
        assert flag in out


def test_a_tiny_soak_writes_its_report(tiny_llama_path: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc = main(["bench", "--scenarios", "soak", "--systems", "ours,mlx_lm", "--rounds", "3",
               "--soak-streams", "2", "--soak-ram-budget", "8MB", "--max-tokens", "2",
               "--model", str(tiny_llama_path), "--out", str(out)])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["scenarios"] == []  # no replayed scenario: no floor either
    soak = results["soak"]
    assert soak["skipped"] == {"mlx_lm": "the soak reads ours' /v1/cache/stats"}
    run = soak["runs"]["ours"]
    assert "error" not in run and run["streams"] == 2 and run["ram_budget"] == "8MB"
    assert run["redis"] is False and set(run["hit_tokens_by_tier"]) <= {"ram", "ssd"}
    assert [s["round"] for s in run["samples"]] == [0, 1, 2]
    # each round: one turn per stream (one of them cancelled after its first chunk)
    assert [s["requests"] for s in run["samples"]] == [2, 4, 6]
    assert all(s["threads"] > 0 and s["fds"] > 0 and s["rss"] > 0 for s in run["samples"])
    summary = run["summary"]
    assert (summary["rounds"], summary["requests"], summary["errors_5xx"],
            summary["refused"], summary["warmup_rounds"]) == (3, 6, 0, 0, 0)
    md = (out / "report.md").read_text()
    assert "## Soak: agent sessions with churn" in md
    assert "| ours | 2 | 3 | " in md and "| mlx_lm | skipped: " in md
    assert "--scenarios soak" in md and "--rounds 3 --soak-streams 2" in md
    assert (out / "charts" / "soak_ours.png").stat().st_size > 5_000
    assert "## Soak" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--minutes", "0"], "--minutes must be > 0, got 0.0"),
    (["--soak-streams", "0"], "--soak-streams must be in 1..256, got 0"),
])
def test_a_soak_with_bad_lengths_is_refused_before_anything_starts(
        argv: list[str], message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["bench", "--scenarios", "soak", "--out", str(out), *argv]) == 2
    assert capsys.readouterr().err == f"promptcache: error: {message}\n"
    assert not out.exists()


def test_a_harness_that_cannot_be_imported_leaves_the_other_commands_working(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    from promptcache.cli import bench_cmd

    (tmp_path / "harness").mkdir()
    (tmp_path / "harness" / "__init__.py").write_text("")  # no command.py
    monkeypatch.setenv(bench_cmd.BENCH_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in [m for m in sys.modules if m == "harness" or m.startswith("harness.")]:
        monkeypatch.delitem(sys.modules, name)
    assert main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"promptcache bench: cannot import the harness in {tmp_path} (")
    assert "harness.command" in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as done:  # serve still parses
        main(["serve", "--help"])
    assert done.value.code == 0


def test_other_commands_start_without_the_harness() -> None:
    """`serve` and the rest build their parser without importing bench/harness: only
    `promptcache bench` imports it, when it runs."""
    import subprocess
    import sys

    code = ("import sys; from promptcache.cli import build_parser; build_parser(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'harness'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out == "[]\n"


def test_the_long_session_is_a_scenario(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc = main(["bench", "--scenarios", "long", "--systems", "ours", "--long-shape", "small",
               "--long-sizes", "256", "--long-new", "16", "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "long_session.json").read_text())
    assert (result["shape"], result["new"], result["skipped"]) == ("small", 16, [])
    (row,) = result["rows"]
    assert row["size"] == 256 and row["live_by_tier"] == {"live": 256}
    # 8 layers' K and V from two runs of blocks (slabs): 32 copies, not one per block
    assert row["copies"] == 32
    assert "mlx_lm_s" not in row  # mlx_lm not named
    # the floor sampled after each of 3 live turns, 3 RAM turns and the SSD turn: its best
    assert len(row["floor_samples"]) == 7 and row["floor_s"] == min(row["floor_samples"])
    f = row["floor_samples"]
    assert (row["live_floors"], row["ram_floors"], row["ssd_floor_s"]) == (f[:3], f[3:6], f[6])
    assert len(row["live_samples"]) == len(row["ram_samples"]) == 3
    md = (out / "report.md").read_text()
    assert "## Long sessions" in md and "\n| 256 | " in md
    assert "--scenarios long" in md and "--long-sizes 256 --long-new 16" in md
