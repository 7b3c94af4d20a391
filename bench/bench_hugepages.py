"""Fresh mlx CPU buffers with and without glibc's huge pages (``GLIBC_TUNABLES=
glibc.malloc.hugetlb=1``, which the ``promptcache`` command sets on Linux): the rate of
``mx.array`` copies of 64 MB and 337 MB host arrays (each a fresh malloc'd buffer), and
one attention-heavy step (256 new tokens over a 32K-token KV of 8 layers, 2 KV heads of 64)
each run in a child process with and without the tunable, the median of 5.

usage: PYTHONPATH=src python bench/bench_hugepages.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = r"""
import json, statistics, time
import mlx.core as mx, numpy as np
out = {}
for mb in (64, 337):
    host = np.ones(mb << 20, dtype=np.uint8)
    ts = []
    for _ in range(5):
        t = time.perf_counter(); a = mx.array(host); mx.eval(a); ts.append(time.perf_counter() - t); del a
    out[f"copy_{mb}MB_GBps"] = round(mb / 1024 / statistics.median(ts), 2)
k = mx.random.normal((1, 2, 32768, 64)); v = mx.random.normal((1, 2, 32768, 64)); mx.eval(k, v)
q = mx.random.normal((1, 4, 256, 64)); mx.eval(q)
ts = []
for _ in range(5):
    t = time.perf_counter()
    outs = [mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=None) for _ in range(8)]
    mx.eval(outs); ts.append(time.perf_counter() - t); del outs
out["attention_8_layers_s"] = round(statistics.median(ts), 4)
print(json.dumps(out))
"""


def run(tunables: str | None) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables:
        env["GLIBC_TUNABLES"] = tunables
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                          text=True, check=True)
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main() -> None:
    off, on = run(None), run("glibc.malloc.hugetlb=1")
    print("| measure | 4 KB pages | huge pages | ratio |\n|---|---|---|---|")
    for key in off:
        print(f"| {key} | {off[key]} | {on[key]} | {on[key] / off[key]:.2f} |")


if __name__ == "__main__":
    main()
