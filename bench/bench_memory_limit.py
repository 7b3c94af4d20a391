"""Long prompts past the memory limit: ``--requests`` concurrent requests, each a
``--tokens``-token prompt, against a real ``promptcache serve`` whose ``--memory-limit``
is a little above its idle footprint, so that they cannot all run at once. Samples the
server's footprint (resident memory) every 50 ms while they run and reports the peak
against the limit, the status of every request (200, or 429 with its Retry-After; a 5xx
is a failure) and what the memory governor released and refused (its engine stats).

``--arrivals-over S`` spreads the requests' starts evenly over S seconds instead of
sending them all at once: a burst is queued before the governor's first check (and then
served one at a time within the limit), while requests that arrive once the footprint is
past the hard watermark are refused with 429 and a Retry-After. With a tight
``--headroom-mb`` this is the run where some requests are refused.

    PYTHONPATH=src python bench/bench_memory_limit.py --model DIR [--requests 48] \\
        [--tokens 4096] [--headroom-mb 256] [--arrivals-over 0] [-- extra serve args]
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
    ap.add_argument("--arrivals-over", type=float, default=0.0, metavar="S",
                    help="start request i at i * S / requests seconds (0: all at once)")
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
    results: list[tuple[int, int, str | None, float, float]] = []
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
            time.sleep(max(0.0, t0 + i * a.arrivals_over / a.requests - time.monotonic()))
            t = time.monotonic()
            r = httpx.post(f"{base}/v1/completions", timeout=1800, json={
                "model": "default", "prompt": f"{i} " + words, "max_tokens": 4})
            with lock:
                results.append((i, r.status_code, r.headers.get("retry-after"), t - t0,
                                time.monotonic() - t))

        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        t0 = time.monotonic() + 0.5  # the pool's threads started
        with ThreadPoolExecutor(a.requests) as pool:
            list(pool.map(one, range(a.requests)))
        done.set()
        watcher.join()
        engine = httpx.get(f"{base}/v1/cache/stats", timeout=30).json()["engine"]
        took = time.monotonic() - t0
    statuses = Counter(s for _, s, _, _, _ in results)
    retries = Counter(int(r) for _, s, r, _, _ in results if s in (429, 529) and r is not None)
    no_retry = sum(1 for _, s, r, _, _ in results if s in (429, 529) and r is None)
    print(f"{a.requests} requests of {a.tokens} words"
          + (f" arriving over {a.arrivals_over:g} s" if a.arrivals_over else " at once")
          + f", done in {took:.1f} s: {dict(sorted(statuses.items()))}")
    print("refused (429 / 529) by Retry-After (s): "
          + (", ".join(f"{k} s x {n}" for k, n in sorted(retries.items())) or "none")
          + (f"; {no_retry} refused without a Retry-After" if no_retry else ""))
    print("per request (arrival order): " + " ".join(
        f"{i}@{start:.1f}s:{s}" + (f"(retry {r})" if r is not None else "")
        for i, s, r, start, _ in sorted(results)))
    print(f"peak footprint {peak[0] / 2**20:.0f} MB of the {limit / 2**20:.0f} MB limit "
          f"({peak[0] / limit:.0%}); 5xx: {sum(n for s, n in statuses.items() if s >= 500)}")
    print("governor: " + ", ".join(f"{k}={engine.get(k)}" for k in (
        "memory_level", "memory_reclaims", "memory_released_bytes", "memory_paused",
        "memory_refused", "memory_refused_peaks", "memory_refused_requests",
        "memory_peak_footprint")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
