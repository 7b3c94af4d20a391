"""The long-session scenario's measurements (``long_run.py`` runs them): a timed call, one
contiguous copy, one sequential read, and the floor sampled beside each timed turn."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from page_cache import drop_files


def timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def copy_time(nbytes: int, fresh: bool = False) -> float:
    """One contiguous copy of ``nbytes`` (read + write once), the fastest of 3; ``fresh``:
    into memory new to the process (mlx's buffer pool emptied first), as a restore's arrays."""
    a = mx.zeros((max(1, nbytes // 4),), dtype=mx.float32)
    mx.eval(a)
    best = float("inf")
    for _ in range(3):
        if fresh:
            mx.clear_cache()
        best = min(best, timed(lambda: mx.eval(a + 0)))
    return best


def parts(result: Any) -> dict[str, float]:
    """Where a turn's time to first token went (the engine's own timings, seconds)."""
    return {k: round(float(getattr(result, k)), 4)
            for k in ("ttft_s", "queue_s", "lookup_s", "restore_s", "prefill_s")}


class Floor:
    """The floor's samples: mlx-lm alone prefilling ``rest`` on ``state`` (as the engine does:
    the chunk's caches, then the last token alone for its logits), ``gap`` s after the last."""

    def __init__(self, model: Any, state: Any, rest: mx.array, gap: float, arrays: Any) -> None:
        self.model, self.state, self.rest, self.gap, self.arrays = model, state, rest, gap, arrays
        self.samples: list[float] = []

    def __call__(self) -> None:
        from mlx_lm.models.cache import trim_prompt_cache

        time.sleep(self.gap)
        t = time.perf_counter()
        self.model(self.rest[:, :-1], cache=self.state)
        mx.eval([x for _, x in self.arrays(self.state)])
        mx.eval(self.model(self.rest[:, -1:], cache=self.state)[0, -1])
        self.samples.append(time.perf_counter() - t)
        trim_prompt_cache(self.state, int(self.rest.shape[1]))


def paired(turn: Any, n: int, floor: Floor, row: dict[str, Any], key: str) -> Any:
    """``turn()`` ``n`` times (a retry trims the last one's state), each followed by a floor
    sample (the pairs' ratios are the targets'); into ``row``: both; returns the fastest."""
    got = []
    for _ in range(n):
        got.append(turn())
        floor()
    row.update({f"{key}_samples": [r.ttft_s for r in got], f"{key}_floors": floor.samples[-n:]})
    return min(got, key=lambda r: r.ttft_s)


def read_time(folder: Path, nbytes: int) -> float:
    """One sequential read (dd, 8 MB blocks) of a file of ``nbytes`` in ``folder``,
    dropped from the page cache first."""
    path = folder / "dd.bin"
    with open(path, "wb") as f:
        chunk = os.urandom(1 << 20)
        for _ in range(max(1, nbytes >> 20)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    drop_files([path])
    took = timed(lambda: subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=8M"],
                                        check=True, capture_output=True))
    path.unlink()
    return took
