"""The verify's cache repair at a decode batch's scale: shifting every row
(``mlx_compat.drop_row_tails`` without ``RowMoves``: mlx-lm's right-padding path, a
roll of the whole buffer) against moving each row's first positions into its rejected
tail (with ``RowMoves``: a copy of the rejected positions only).

A batch of ``--rows`` rows x ``--context`` positions in ``--layers`` KV layers of
SmolLM2-135M's shape (3 KV heads x 64, fp32); each repeat feeds 5 positions per row and
drops a different number from each row (1, 2, 3, 0, 4, 1, 2, 3, ...), timed with the
evaluation of the repaired caches (the first repeat is a warm-up).

Usage: .venv/bin/python bench/bench_repair.py [--rows 8] [--context 1300] [--layers 30]
       [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from promptcache.engine import mlx_compat

HEADS, DIM = 3, 64


def batch(rows: int, context: int, layers: int) -> list[BatchKVCache]:
    out = []
    for _ in range(layers):
        c = BatchKVCache([0] * rows)
        k = mx.random.normal((rows, HEADS, context, DIM))
        c.update_and_fetch(k, k)
        out.append(c)
    mx.eval([c.keys for c in out] + [c.values for c in out])
    return out


def run(rows: int, context: int, layers: int, repeats: int, move: bool) -> list[float]:
    caches = batch(rows, context, layers)
    moves = [mlx_compat.RowMoves() for _ in range(rows)] if move else None
    drops = [(1, 2, 3, 0, 4)[i % 5] for i in range(rows)]
    times = []
    for _ in range(repeats + 1):
        fed = mx.random.normal((rows, HEADS, 5, DIM))
        for c in caches:
            c.update_and_fetch(fed, fed)
        mx.eval([c.keys for c in caches] + [c.values for c in caches])
        t0 = time.perf_counter()
        mlx_compat.drop_row_tails(caches, drops, moves)
        mx.eval([c.keys for c in caches] + [c.values for c in caches])
        times.append(time.perf_counter() - t0)
    return times[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=1300)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    for name, move in (("shift every row", False), ("move the heads", True)):
        t = sorted(run(a.rows, a.context, a.layers, a.repeats, move))
        print(f"{name:16s} {a.rows} rows x {a.context} positions x {a.layers} layers: "
              f"median {t[len(t) // 2] * 1e3:7.1f} ms  (min {t[0] * 1e3:.1f})", flush=True)


if __name__ == "__main__":
    main()
