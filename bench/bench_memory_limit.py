"""Long prompts past the memory limit: ``--requests`` concurrent requests, each a
``--tokens``-token prompt, against a real ``promptcache serve`` whose ``--memory-limit``
is a little above its idle footprint, so that they cannot all run at once. Samples the
server's footprint (resident memory) every 50 ms while they run and reports the peak
against the limit, the status of every request (200, or 429 with its Retry-After; a 5xx
is a failure) and what the memory governor released and refused (its engine stats).

    PYTHONPATH=src python bench/bench_memory_limit.py --model DIR [--requests 48] \\
        [--tokens 4096] [--headroom-mb 256] [-- extra serve args]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

from harness.soak import WORDS, server


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--headroom-mb", type=int, default=256,
                    help="the limit is the idle footprint + this")
    ap.add_argument("serve_args", nargs="*")
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="pc-memlimit-"))
    # a first server measures the idle footprint (the model loaded, warmed by a request)
    with server(a.model, tmp / "idle.log", cache_dir=tmp / "blocks",
                extra_args=[*a.serve_args, "--memory-limit", "off"]) as (base, pid):
        httpx.post(f"{base}/v1/completions", json={"model": "default", "prompt": "hello",
                                                     "max_tokens": 2}, timeout=300)
        idle = psutil.Process(pid).memory_info().rss
    limit = idle + a.headroom_mb * 2**20
    print(f"idle footprint {idle / 2**20:.0f} MB; --memory-limit {limit / 2**20:.0f} MB "
          f"(soft {0.85 * limit / 2**20:.0f}, hard {0.95 * limit / 2**20:.0f})")
    words = " ".join(WORDS[i % len(WORDS)] for i in range(a.tokens))
    results: list[tuple[int, str | None, float]] = []
    lock = threading.Lock()
    with server(a.model, tmp / "server.log", cache_dir=tmp / "blocks",
                extra_args=[*a.serve_args, "--memory-limit", str(limit), "--max-queue", "256"]
                ) as (base, pid):
        proc = psutil.Process(pid)
        peak = [0]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], proc.memory_info().rss)
                time.sleep(0.05)

        def one(i: int) -> None:
            t = time.monotonic()
            r = httpx.post(f"{base}/v1/completions", timeout=1800, json={
                "model": "default", "prompt": f"{i} " + words, "max_tokens": 4})
            with lock:
                results.append((r.status_code, r.headers.get("retry-after"),
                                time.monotonic() - t))

        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        t0 = time.monotonic()
        with ThreadPoolExecutor(a.requests) as pool:
            list(pool.map(one, range(a.requests)))
        done.set()
        watcher.join()
        engine = httpx.get(f"{base}/v1/cache/stats", timeout=30).json()["engine"]
        took = time.monotonic() - t0
    statuses = Counter(s for s, _, _ in results)
    retries = sorted(int(r) for s, r, _ in results if s in (429, 529) and r is not None)
    print(f"{a.requests} requests of {a.tokens} words in {took:.1f} s: {dict(statuses)}; "
          f"Retry-After of the refused: {retries}")
    print(f"peak footprint {peak[0] / 2**20:.0f} MB of the {limit / 2**20:.0f} MB limit "
          f"({peak[0] / limit:.0%}); 5xx: {sum(n for s, n in statuses.items() if s >= 500)}")
    print("governor: " + ", ".join(f"{k}={engine.get(k)}" for k in (
        "memory_level", "memory_reclaims", "memory_released_bytes", "memory_paused",
        "memory_refused", "memory_refused_peaks", "memory_refused_requests",
        "memory_peak_footprint")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
