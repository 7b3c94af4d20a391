"""The long-session scenario's pure parts (``long_run.py`` does the mlx
work): the report table from the measured rows, the time estimate that decides whether
a size still fits the run's budget, and one timed text completion on a peer server.

A row is the dict the bench measures at one size (times in seconds):
``size``, ``floor_s``, ``live_s``, ``ram_s``, ``copy_s``, ``copies``, ``ssd_s``, ``read_s``,
``cold_s`` (the whole prompt prefilled on an empty cache), ``mlx_lm_s`` (the same next
turn on mlx_lm.server; absent when it did not run), ``redis_s`` (with ``--redis``);
``live_samples`` / ``live_floors``, ``ram_samples`` / ``ram_floors`` (each turn and the floor
sampled right after it) and ``ssd_floor_s`` (the floor right after the SSD turn) where measured.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx


def ratios(row: Mapping[str, Any]) -> dict[str, float | None]:
    """The targets' ratios of one row (None where a figure is missing).

    - ``live_floor``: the live state / the floor (target <= 1.05)
    - ``ram_copy``: (RAM tier - floor) / one copy of the restored bytes (target <= 1.2)
    - ``ssd_read``: SSD after a restart / (dd of its bytes + floor) (target <= 1.2)

    the first two the median over the pairs (a turn, the floor right after it) where the row
    has them (the machine's drift between a turn and its floor is small, between phases not);
    the third with the floor sampled right after the SSD turn where there is one;
    - ``ssd_cold``: SSD after a restart / a cold prefill (target <= 1)
    - ``mlx_floor``: mlx_lm.server / the floor
    - ``live_mlx``: ours (the live state) / mlx_lm.server
    """
    def div(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b <= 0 else a / b

    def paired(key: str, f: Any) -> float | None:
        turns, floors = row.get(f"{key}_samples"), row.get(f"{key}_floors")
        if not turns or not floors or len(turns) != len(floors):
            return None
        got = [f(t, x) for t, x in zip(turns, floors, strict=True)]
        return None if None in got else statistics.median(got)

    floor = row.get("floor_s")
    ram = row.get("ram_s")
    mlx = row.get("mlx_lm_s")
    copy = row.get("copy_s")
    ssd_floor = row.get("ssd_floor_s", floor)
    live_floor = paired("live", div)
    ram_copy = paired("ram", lambda t, x: div(t - x, copy))
    return {
        "live_floor": live_floor if live_floor is not None else div(row.get("live_s"), floor),
        "ram_copy": ram_copy if ram_copy is not None else div(
            None if ram is None or floor is None else ram - floor, copy),
        "ssd_read": div(row.get("ssd_s"),
                        None if row.get("read_s") is None or ssd_floor is None
                        else row["read_s"] + ssd_floor),
        "ssd_cold": div(row.get("ssd_s"), row.get("cold_s")),
        "mlx_floor": div(mlx, floor),
        "live_mlx": div(row.get("live_s"), mlx),
    }


def estimate_s(done: Sequence[tuple[int, float]], size: int) -> float | None:
    """How long measuring ``size`` tokens will take, from the last size measured
    (``done``: (tokens, seconds) per size): its time scaled by the square of the sizes'
    ratio (growing the conversation and the cold prefill are quadratic in the context;
    an upper estimate for the rest). None before any size was measured."""
    if not done:
        return None
    last_size, last_s = done[-1]
    return last_s * (size / last_size) ** 2


def over_budget(done: Sequence[tuple[int, float]], size: int, budget_min: float) -> str | None:
    """Why ``size`` is not measured (its estimate exceeds ``budget_min`` minutes), or None."""
    guess = estimate_s(done, size)
    if guess is None or guess <= 60 * budget_min:
        return None
    last_size, last_s = done[-1]
    return (f"{size} tokens: estimated {guess / 60:.0f} min (the {last_size}-token size took "
            f"{last_s / 60:.1f} min, x{(size / last_size) ** 2:.1f}) > the budget of "
            f"{budget_min:g} min")


def _s(x: float | None, digits: int = 3) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def _r(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def table(rows: Sequence[Mapping[str, Any]], *, redis: bool,
          skipped: Sequence[str] = ()) -> str:
    """The markdown table (times in seconds), one row per size, then a line per size
    not measured (``skipped``: why)."""
    cols = ["tokens", "floor", "live", "live / floor", "RAM", "(RAM - floor) / copy", "copy",
            "restore copies", "SSD after restart", "SSD / (dd + floor)", "dd",
            *(["Redis"] if redis else []), "mlx_lm.server", "mlx_lm.server / floor",
            "live / mlx_lm.server", "cold prefill", "SSD / cold"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        q = ratios(r)
        cells = [str(r["size"]), _s(r.get("floor_s")), _s(r.get("live_s")),
                 _r(q["live_floor"]), _s(r.get("ram_s")), _r(q["ram_copy"]),
                 _s(r.get("copy_s")), "" if r.get("copies") is None else str(r["copies"]),
                 _s(r.get("ssd_s")), _r(q["ssd_read"]), _s(r.get("read_s")),
                 *([_s(r.get("redis_s"))] if redis else []),
                 _s(r.get("mlx_lm_s")), _r(q["mlx_floor"]), _r(q["live_mlx"]),
                 _s(r.get("cold_s"), 2), _r(q["ssd_cold"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [f"- not measured: {why}" for why in skipped]
    return "\n".join(lines)


def complete_once(base_url: str, prompt: str, *, timeout_s: float = 3600.0) -> tuple[float, dict[str, Any]]:
    """One text completion of one token (``POST /v1/completions``, not streamed, greedy);
    returns (seconds from sending to the whole answer, its ``usage``)."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0, "stream": False}
    t0 = time.perf_counter()
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=timeout_s)
    took = time.perf_counter() - t0
    r.raise_for_status()
    usage = r.json().get("usage") or {}
    return took, dict(usage) if isinstance(usage, dict) else {}
