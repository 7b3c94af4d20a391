"""A soak of a real ``promptcache serve`` process: ``streams`` agent-like sessions at once,
with churn, round after round, sampling what the process holds after each round.

Each round every stream sends one request at the same time: the next turn of its
session (the history, the model's reply, a new user message), or, every few turns, the
first turn of a new session; one stream of the round streams its reply and hangs up
after the first chunk (a cancelled stream); and one hostile request rides along (an
unknown role: a 400). After the round: the server's resident memory, threads and file
descriptors (psutil on its PID), and from ``/v1/cache/stats`` the MLX arrays the RAM
tier and the live states hold, MLX's active and cached bytes, and the 5xx seen so far.

Used by ``tests/server/test_soak.py`` (a short run in ``make test``, asserting that
nothing grows after warm-up) and ``bench/bench_soak.py`` (minutes long, a chart).
Importable from every test folder (``tests/`` is on ``sys.path``)."""

from __future__ import annotations

import random
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from serve_proc import PROMPTCACHE, stop, wait_healthy

from promptcache.bench.systems import free_port

WORDS = ("cache block token layer memory request server answer question value order "
         "result file function test build change update design number string list table "
         "write read load store index search match prefix suffix context history message "
         "reply user agent tool call input output error retry check limit budget").split()


@dataclass
class Sample:
    round: int
    t: float
    rss: int
    threads: int
    fds: int
    ram_arrays: int
    live_arrays: int
    live_states: int
    mlx_active: int
    mlx_cache: int
    requests: int
    errors_5xx: int
    refused: int  # 429 / 529 (the memory limit or the queue)
    # resident memory by kind (``memory_parts``; {} where /proc has no smaps)
    parts: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def memory_parts(pid: int) -> dict[str, int]:
    """The resident bytes of ``pid`` by the kind of mapping they are in (Linux
    ``/proc/PID/smaps``): ``heap`` (glibc's main arena), ``arenas`` (glibc's other
    arenas: 64 MB reservations, one per thread that allocates), ``pymalloc`` (Python's
    1 MB object arenas), ``mmap`` (other anonymous mappings: allocations past glibc's
    mmap threshold, MLX's and numpy's large buffers, thread stacks), ``file`` (mapped
    files: libraries, the model's weights). Empty where there is no smaps."""
    parts = {"heap": 0, "arenas": 0, "pymalloc": 0, "mmap": 0, "file": 0}
    kind = "mmap"
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split(maxsplit=6)
                if "-" in head[0] and len(head) >= 5 and ":" in head[3]:
                    start, end = (int(x, 16) for x in head[0].split("-"))
                    name = head[5].strip() if len(head) > 5 else ""
                    size = end - start
                    kind = ("heap" if name == "[heap]" else "file" if name.startswith("/")
                            else "mmap" if name else
                            "arenas" if start % (64 << 20) == 0  # glibc aligns them
                            else "pymalloc" if size == 1 << 20 else "mmap")
                elif line.startswith("Rss:"):
                    parts[kind] += int(line.split()[1]) * 1024
    except OSError:
        return {}
    return parts


@contextmanager
def server(args: Sequence[str], log_path: Path, timeout: float = 120.0
           ) -> Iterator[tuple[str, int]]:
    """``promptcache serve --port <free> *args``; yields (base URL, PID) once healthy,
    stops it by its PID afterwards (``serve_proc``'s wait and stop)."""
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([PROMPTCACHE, "serve", "--port", str(port), *args],
                                stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, log_path, timeout)
        yield base, proc.pid
    finally:
        stop(proc)


class _Session:
    def __init__(self, rng: random.Random, sid: str) -> None:
        self.sid = sid
        self.turns = 0
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": "You are a coding agent. " + _words(rng, 40)},
            {"role": "user", "content": _words(rng, 60)}]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def run(base: str, pid: int, *, streams: int = 8, rounds: int | None = None,
        minutes: float | None = None, max_tokens: int = 8, turns_per_session: int = 4,
        seed: int = 0, on_sample: Any = None) -> list[Sample]:
    """Rounds until ``rounds`` are done or ``minutes`` have passed; a sample per round."""
    if rounds is None and minutes is None:
        raise ValueError("give rounds or minutes")
    rng = random.Random(seed)
    proc = psutil.Process(pid)
    sessions = [_Session(rng, f"soak-{i}-0") for i in range(streams)]
    counts = {"requests": 0, "5xx": 0, "refused": 0}
    lock = threading.Lock()
    t0 = time.monotonic()
    out: list[Sample] = []

    def count(status: int) -> None:
        with lock:
            counts["requests"] += 1
            counts["5xx"] += status >= 500 and status != 529
            counts["refused"] += status in (429, 529)

    def turn(client: httpx.Client, s: _Session, cancel: bool) -> None:
        body = {"model": "default", "max_tokens": max_tokens, "messages": s.messages,
                "stream": cancel}
        headers = {"X-Session-Id": s.sid}
        if cancel:  # hang up after the first chunk
            with client.stream("POST", f"{base}/v1/chat/completions", json=body,
                               headers=headers) as r:
                count(r.status_code)
                for _ in r.iter_bytes():
                    break
            return
        r = client.post(f"{base}/v1/chat/completions", json=body, headers=headers)
        count(r.status_code)
        if r.status_code == 200:
            reply = r.json()["choices"][0]["message"].get("content") or ""
            s.messages = [*s.messages, {"role": "assistant", "content": reply},
                          {"role": "user", "content": _words(rng, 30)}]
            s.turns += 1

    def hostile(client: httpx.Client) -> None:
        r = client.post(f"{base}/v1/chat/completions", json={
            "model": "default", "max_tokens": 4,
            "messages": [{"role": "wizard", "content": "x"}]})
        if r.status_code != 400:
            raise AssertionError(f"a hostile request got {r.status_code}: {r.text[:200]}")

    with httpx.Client(timeout=300) as client, ThreadPoolExecutor(streams + 1) as pool:
        i = 0
        while True:
            if rounds is not None and i >= rounds:
                break
            if minutes is not None and time.monotonic() - t0 > minutes * 60:
                break
            for j, s in enumerate(sessions):  # churn: sessions end and new ones start
                if s.turns >= turns_per_session:
                    sessions[j] = _Session(rng, f"soak-{j}-{i}")
            cancel_at = i % streams
            futures = [pool.submit(turn, client, s, j == cancel_at)
                       for j, s in enumerate(sessions)]
            futures.append(pool.submit(hostile, client))
            for f in futures:
                f.result()
            stats = client.get(f"{base}/v1/cache/stats").json()
            e = stats.get("engine", {})
            with lock:
                sample = Sample(i, time.monotonic() - t0, int(proc.memory_info().rss),
                                proc.num_threads(), proc.num_fds(),
                                int(e.get("ram_arrays", 0)), int(e.get("live_arrays", 0)),
                                int(e.get("live_states", 0)),
                                int(e.get("mlx_active_bytes", 0)),
                                int(e.get("mlx_cache_bytes", 0)), counts["requests"],
                                counts["5xx"], counts["refused"], memory_parts(pid))
            out.append(sample)
            if on_sample is not None:
                on_sample(sample)
            i += 1
    return out
