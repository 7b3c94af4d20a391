"""bench/bench_planner.py end to end at tiny sizes: its structure, not its timings."""

from __future__ import annotations

import json
from pathlib import Path

import bench_planner
import pytest


def test_bench_planner_tiny(tiny_llama_path: Path, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "planner.json"
    result = bench_planner.run(["--shape", "tiny", "--sizes", "128,192", "--repeats", "3",
                                "--gap", "0", "--tokenizer", str(tiny_llama_path),
                                "--dir", str(tmp_path / "tier"), "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert (result["shape"], result["tier"], result["kv_bytes_per_token"]) == ("tiny", "ssd",
                                                                               2048)
    rows = result["rows"]
    assert [r["size"] for r in rows] == [128, 192]
    for r in rows:
        assert {m: len(r["times"][m]) for m in bench_planner.MODES} == {
            "load": 3, "recompute": 3, "auto": 3}
        assert r["identical"] is True  # every request's tokens = a full prefill's
        assert sum(r["auto_plans"].values()) == 3 and len(r["auto_described"]) == 3
        assert all(d.split("/")[1].startswith("auto[0:") for d in r["auto_described"])
        assert len(r["auto_splices"]) == 3
    e = result["engine"]
    # each size: 3 forced loads, 3 forced recomputes (its first request matched nothing)
    assert e["restore_plans_by_why"] == {"forced": 12, "auto": 6}
    kinds = e["restore_plans_by_kind"]
    assert sum(kinds.values()) == 18 and set(kinds) <= {"load", "recompute", "split"}
    assert kinds["load"] >= 6 and kinds["recompute"] >= 6
    assert e["restore_rates"]["reads"]["ssd"]["samples"] >= 6
    md = capsys.readouterr().out.splitlines()
    assert md[0] == ("| prefix tokens | load s | recompute s | recompute / load | auto s "
                     "| auto / best | per round | auto's plans | identical |")
    assert md[1] == "|" + "---|" * 9
    assert [line.split(" | ")[0] for line in md[2:]] == ["| 128", "| 192"]
    assert all(line.endswith("| True |") for line in md[2:])


def test_per_round_is_the_median_of_each_rounds_ratio() -> None:
    row = {"times": {"load": [1.0, 2.0, 4.0], "recompute": [2.0, 1.0, 8.0],
                     "auto": [0.5, 1.5, 2.0]}}
    # rounds: 0.5 / 1.0, 1.5 / 1.0, 2.0 / 4.0
    assert bench_planner.per_round(row) == 0.5
