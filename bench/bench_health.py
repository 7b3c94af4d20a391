"""Does the event loop stay free while a long chat is prepared?

Starts `promptcache serve` on a tiny model (a real BPE tokenizer and ChatML template),
sends one chat completion with N messages (default 200, ~60 words each: the template is
rendered once per message prefix to find message offsets, then tokenized), and meanwhile
polls GET /health every 20 ms. Reports the latency of /health while that request is in
flight. With the default ``--kind llama`` (a 4096-token window) the ~20K-token chat is
refused with a 400 right after it was prepared, so the measured window is the
preparation alone (no prefill); ``--kind scripted`` (128K window) prefills it too. With
``--compare-with PATH`` it runs the same against another `promptcache` executable (e.g.
the main checkout, whose handlers render on the event loop), in the same invocation.

    .venv/bin/python bench/bench_health.py [--messages 200] [--compare-with /work/main/.venv/bin/promptcache]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))  # models: the tiny test models

from models.tiny_models import ensure_tiny_model  # noqa: E402

from harness.systems import free_port  # noqa: E402

WORDS = ("the cache is warm and the model reads a long history of messages before it "
         "answers one more question about code files tests and servers").split()


def chat(n: int, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    msgs = [{"role": "system", "content": "You are a helpful assistant."}]
    for i in range(n - 1):
        role = "user" if i % 2 == 0 else "assistant"
        msgs.append({"role": role, "content": " ".join(rng.choice(WORDS) for _ in range(60))})
    if msgs[-1]["role"] != "user":
        msgs.append({"role": "user", "content": "and now?"})
    return msgs


def measure(exe: str, model: Path, n: int) -> dict[str, float]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen([exe, "serve", "--model", str(model), "--port", str(port),
                                 "--no-ssd", "--log-level", "warning"], env=env,
                                stdout=open(Path(tmp) / "log", "w"), stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError((Path(tmp) / "log").read_text())
                time.sleep(0.2)
            body = {"model": "default", "messages": chat(n), "max_tokens": 1}
            # warm up (template compiled, probes done) with a different short chat
            httpx.post(f"{base}/v1/chat/completions", json={**body, "messages": chat(3, 1)},
                       timeout=600)
            done = threading.Event()
            latencies: list[float] = []
            result: dict[str, float] = {}

            def send() -> None:
                t0 = time.monotonic()
                r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=600)
                result["request_s"] = time.monotonic() - t0
                result["status"] = r.status_code
                done.set()

            sender = threading.Thread(target=send)
            with httpx.Client() as poll:
                sender.start()
                time.sleep(0.05)
                while not done.is_set():
                    t0 = time.monotonic()
                    poll.get(f"{base}/health", timeout=60)
                    latencies.append(time.monotonic() - t0)
                    time.sleep(0.02)
            sender.join()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    latencies.sort()
    return {**result, "polls": len(latencies),
            "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "max_ms": 1000 * latencies[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=200)
    ap.add_argument("--kind", default="llama", choices=("llama", "scripted"))
    ap.add_argument("--compare-with", default=None,
                    help="another promptcache executable to measure in the same run")
    args = ap.parse_args()
    model = ensure_tiny_model(args.kind, REPO / ".models")
    systems = [("this checkout", str(Path(sys.executable).parent / "promptcache"))]
    if args.compare_with:
        systems.append(("compared", args.compare_with))
    print(f"{args.messages} messages; /health polled every 20 ms while the request runs")
    print("| server | status | request s | /health polls | p50 ms | p99 ms | max ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, exe in systems:
        m = measure(exe, model, args.messages)
        print(f"| {name} | {m['status']:.0f} | {m['request_s']:.2f} | {m['polls']:.0f} "
              f"| {m['p50_ms']:.1f} | {m['p99_ms']:.1f} | {m['max_ms']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
