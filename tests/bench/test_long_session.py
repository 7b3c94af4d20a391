"""The long-session scenario's report (``harness.long_session``), from made-up numbers."""

from __future__ import annotations

import pytest

from harness.long_session import estimate_s, over_budget, ratios, table

ROW = {"size": 8193, "floor_s": 1.0, "live_s": 1.05, "ram_s": 1.25, "copy_s": 0.2,
       "copies": 48, "ssd_s": 1.5, "read_s": 0.25, "cold_s": 10.0, "mlx_lm_s": 1.4,
       "redis_s": 2.0}


def test_ratios_of_a_row() -> None:
    q = ratios(ROW)
    assert q == pytest.approx({"live_floor": 1.05, "ram_copy": 1.25, "ssd_read": 1.2,
                               "ssd_cold": 0.15, "mlx_floor": 1.4, "live_mlx": 0.75})
    # a figure not measured leaves its ratios empty, not zero and not an error
    partial = ratios({k: v for k, v in ROW.items() if k not in ("mlx_lm_s", "cold_s")})
    assert (partial["mlx_floor"], partial["live_mlx"], partial["ssd_cold"]) == (None,) * 3
    assert partial["live_floor"] == pytest.approx(1.05)


def test_the_targets_are_the_medians_of_the_pairs() -> None:
    # each turn beside the floor sampled right after it: the median of the pairs' ratios,
    # not the fastest turn over the fastest floor of another moment
    row = {**ROW, "live_samples": [1.2, 2.2, 1.0], "live_floors": [1.0, 2.0, 1.0],
           "ram_samples": [1.5, 1.1, 2.3], "ram_floors": [1.0, 1.0, 2.0], "ssd_floor_s": 1.25}
    q = ratios(row)
    assert q["live_floor"] == pytest.approx(1.1)  # median of 1.2, 1.1, 1.0
    assert q["ram_copy"] == pytest.approx(1.5)  # median of 2.5, 0.5, 1.5 copies of 0.2 s
    assert q["ssd_read"] == pytest.approx(1.5 / (0.25 + 1.25))  # the floor after the SSD turn
    # samples without their floors (or of other lengths) fall back to the fastest of each
    assert ratios({**ROW, "live_samples": [1.2], "live_floors": []})["live_floor"] == 1.05


def test_table_has_the_new_columns() -> None:
    md = table([ROW], redis=True).splitlines()
    assert md[0] == ("| tokens | floor | live | live / floor | RAM | (RAM - floor) / copy "
                     "| copy | restore copies | SSD after restart | SSD / (dd + floor) | dd "
                     "| Redis | mlx_lm.server | mlx_lm.server / floor | live / mlx_lm.server "
                     "| cold prefill | SSD / cold |")
    assert md[1] == "|" + "---|" * 17
    assert md[2] == ("| 8193 | 1.000 | 1.050 | 1.05 | 1.250 | 1.25 | 0.200 | 48 | 1.500 "
                     "| 1.20 | 0.250 | 2.000 | 1.400 | 1.40 | 0.75 | 10.00 | 0.15 |")
    # without Redis and without mlx_lm.server: no Redis column, empty peer cells
    no_peer = {k: v for k, v in ROW.items() if k != "mlx_lm_s"}
    md = table([no_peer], redis=False, skipped=["65536 tokens: too long"]).splitlines()
    assert "Redis" not in md[0] and md[1] == "|" + "---|" * 16
    assert md[2] == ("| 8193 | 1.000 | 1.050 | 1.05 | 1.250 | 1.25 | 0.200 | 48 | 1.500 "
                     "| 1.20 | 0.250 |  |  |  | 10.00 | 0.15 |")
    assert md[3] == "- not measured: 65536 tokens: too long"


def test_a_size_over_the_budget_is_skipped_with_its_estimate() -> None:
    assert estimate_s([], 8192) is None and over_budget([], 8192, 15) is None
    done = [(8192, 60.0), (16384, 240.0)]
    assert estimate_s(done, 32768) == 960.0  # the last size's time x (2 x 2)
    assert over_budget(done, 32768, 16) is None  # 16 min: fits
    assert over_budget(done, 32768, 15) == (
        "32768 tokens: estimated 16 min (the 16384-token size took 4.0 min, x4.0) > the "
        "budget of 15 min")
