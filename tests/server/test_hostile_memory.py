"""Memory under hostile load, against a real ``promptcache serve`` of a tiny model: 48
concurrent 1.5k-token prompts are all answered (200 or 429, never 5xx); then a 50 MB
body is a 413 from its Content-Length and adds nothing to the server's peak RSS (it is
never read), a 10 MB chat and a 10,000-message chat are a 400 context_length_exceeded
after a bounded tokenization and add at most a few copies of their size; a small chat
is served after it all. (What the 48 prompts add is not bounded by the configured
budgets alone yet: mlx's buffer cache and per-request Python objects come on top.)"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil  # type: ignore[import-untyped]
from serve_proc import serve

RAM_BUDGET = 64 * 1024**2
KV_BUDGET = 128 * 1024**2


class PeakRSS:
    """The peak resident size of one process, sampled every 20 ms."""

    def __init__(self, proc: psutil.Process) -> None:
        self.proc = proc
        self.peak = proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_rss_stays_within_the_budgets_under_hostile_load(tiny_llama_path: Path,
                                                         tmp_path: Path) -> None:
    args = ["--model", str(tiny_llama_path), "--no-ssd", "--ram-budget", str(RAM_BUDGET),
            "--kv-budget", str(KV_BUDGET), "--block-size", "16", "--no-prerender"]
    with serve(args, tmp_path / "server.log") as base:
        server = next(p for p in psutil.Process().children(recursive=True)
                      if "serve" in " ".join(p.cmdline()))
        c = httpx.Client(base_url=base, timeout=600)
        small = {"model": "default", "max_tokens": 4,
                 "messages": [{"role": "user", "content": "hi"}]}
        assert c.post("/v1/chat/completions", json=small).status_code == 200  # warm
        words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()

        def prompt(i: int) -> dict[str, Any]:
            text = " ".join(words[(i + j) % len(words)] + str(j % 97) for j in range(600))
            return {"model": "default", "max_tokens": 8,
                    "messages": [{"role": "user", "content": f"{i}: {text}"}]}

        statuses: list[int] = []
        with ThreadPoolExecutor(48) as pool:
            futures = [pool.submit(c.post, "/v1/chat/completions", json=prompt(i))
                       for i in range(48)]
            statuses += [f.result().status_code for f in futures]
        assert all(s in (200, 429) for s in statuses), statuses
        assert statuses.count(200) >= 16  # at least the admitted ones
        # the hostile bodies, one at a time: the peak RSS each adds to the server
        def grows(content: bytes) -> tuple[int, int]:
            before = server.memory_info().rss
            with PeakRSS(server) as rss:
                status = c.post("/v1/chat/completions", content=content,
                                headers={"content-type": "application/json"}).status_code
            return status, rss.peak - before

        mb = 1024**2
        huge = b'{"model": "default", "messages": [{"role": "user", "content": "' + \
            b"x" * (50 * mb) + b'"}]}'
        status, grown = grows(huge)
        del huge
        assert status == 413 and grown <= 2 * mb, grown  # never read
        ten = json.dumps({**small, "messages": [
            {"role": "user", "content": "word " * 2_000_000}]}).encode()
        status, grown = grows(ten)
        # parsed and rendered (a few copies of 10 MB), tokenized only up to the window
        assert status == 400 and grown <= 8 * len(ten), grown
        many = json.dumps({**small, "messages": [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"}
            for i in range(10_001)]}).encode()
        status, grown = grows(many)
        assert status == 400 and grown <= 64 * len(many), (grown, len(many))
        assert c.post("/v1/chat/completions", json=small).status_code == 200
