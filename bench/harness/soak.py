"""The soak: ``streams`` agent-like sessions at once against a real ``promptcache serve``,
with churn, round after round, sampling what the process holds after each round.

Each round every stream sends one request at the same time: the next turn of its
session (the history, the model's reply, a new user message), or, every few turns, the
first turn of a new session; one stream of the round streams its reply and hangs up
after the first chunk (a cancelled stream); and one hostile request rides along (an
unknown role: a 400). A small RAM budget makes the RAM tier evict to the SSD tier and
the next turns restore from it. After the round: the server's resident memory, threads
and file descriptors (psutil on its PID), and from ``/v1/cache/stats`` the MLX arrays
the RAM tier and the live states hold, MLX's active and cached bytes, and the 5xx seen
so far. At the end: the prompt tokens each tier gave back (``hit_tokens_by_tier``); with
``redis`` a redis-server is the shared tier and the SSD tier gets the RAM tier's small
budget, so blocks come back from all three.

`promptcache bench --scenarios soak` runs it for ``--minutes`` (``run_soak``: a summary
of each figure's range after warm-up, Markdown, a chart); ``tests/server/test_soak.py``
runs a short version in ``make test``, asserting that nothing grows after warm-up."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil  # type: ignore[import-untyped]

from .redisproc import RedisServer
from .systems import ServerProcess

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
def server(model: str, log_path: Path, *, cache_dir: Path, extra_args: Sequence[str] = (),
           system: str = "ours", timeout: float = 120.0) -> Iterator[tuple[str, int]]:
    """``system`` (``promptcache serve`` on a free port, ``systems.ServerProcess``) on
    ``model`` with ``extra_args``; yields (base URL, PID) once it answers, stops it
    (SIGTERM, then SIGKILL) afterwards."""
    srv = ServerProcess(system, model, log_path, cache_dir=cache_dir,
                        extra_args=tuple(extra_args), ready_timeout_s=timeout)
    srv.start()
    try:
        if srv.pid is None:
            raise RuntimeError(f"{system} has no process")
        yield srv.base_url, srv.pid
    finally:
        srv.stop()


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
        seed: int = 0, on_sample: Callable[[Sample], None] | None = None) -> list[Sample]:
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
                                counts["5xx"], counts["refused"], memory_parts(proc.pid))
            out.append(sample)
            if on_sample is not None:
                on_sample(sample)
            i += 1
    return out


def summarize(samples: Sequence[Sample], warmup: float = 0.25) -> dict[str, Any]:
    """Totals, and each figure's range over the rounds after the first ``warmup`` share
    (at least the last round)."""
    if not samples:
        raise ValueError("no samples")
    after = samples[min(int(len(samples) * warmup), len(samples) - 1):]
    last = samples[-1]

    def span(values: Sequence[int]) -> list[int]:
        return [min(values), max(values)]

    rss = span([s.rss for s in after])
    mid = (rss[0] + rss[1]) / 2
    return {
        "rounds": len(samples), "minutes": round(last.t / 60, 2),
        "requests": last.requests, "errors_5xx": last.errors_5xx, "refused": last.refused,
        "warmup_rounds": len(samples) - len(after),
        "rss": rss, "rss_spread": (rss[1] - mid) / mid if mid else 0.0,
        "threads": span([s.threads for s in after]), "fds": span([s.fds for s in after]),
        "arrays": span([s.ram_arrays + s.live_arrays for s in after]),
        "live_states": span([s.live_states for s in after]),
        "mlx_active": span([s.mlx_active for s in after]),
        "mlx_cache": span([s.mlx_cache for s in after]),
    }


def markdown(runs: dict[str, dict[str, Any]], skipped: dict[str, str], command: str = "") -> str:
    """The soak's section of report.md (the command above it): one row per system."""
    lines = ["## Soak: agent sessions with churn",
             "",
             "Each round: every stream's next turn (new sessions as old ones end), one "
             "cancelled stream, one hostile request (a 400). Ranges after warm-up.",
             ""]
    if command:
        lines += ["```", command, "```", ""]
    lines += ["| system | streams | rounds | minutes | requests | 5xx | refused | resident MB "
              "| threads | fds | MLX arrays | MLX active MB | hit tokens by tier |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def mb(pair: Sequence[int]) -> str:
        return f"{pair[0] / 2**20:.0f}-{pair[1] / 2**20:.0f}"

    for name, r in runs.items():
        if r.get("error"):
            lines.append(f"| {name} | error: {r['error']} |")
            continue
        s = r["summary"]
        tiers = ", ".join(f"{k} {v:,}" for k, v in (r.get("hit_tokens_by_tier") or {}).items())
        lines.append(
            f"| {name} | {r['streams']} | {s['rounds']} | {s['minutes']:.2f} | {s['requests']} "
            f"| {s['errors_5xx']} | {s['refused']} | {mb(s['rss'])} (±{s['rss_spread']:.1%}) "
            f"| {s['threads'][0]}-{s['threads'][1]} | {s['fds'][0]}-{s['fds'][1]} "
            f"| {s['arrays'][0]}-{s['arrays'][1]} | {mb(s['mlx_active'])} "
            f"| {tiers or '—'} |")
    for name, why in skipped.items():
        lines.append(f"| {name} | skipped: {why} |")
    return "\n".join(lines) + "\n"


def chart(samples: Sequence[Sample], path: Path) -> Path:
    """Resident memory, threads and descriptors, MLX arrays, MLX active bytes over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t / 60 for s in samples]
    fig, axes = plt.subplots(2, 2, figsize=(11, 6), sharex=True)
    series: list[tuple[str, list[float] | None]] = [
        ("resident memory (MB)", [s.rss / 2**20 for s in samples]),
        ("threads / file descriptors", None),
        ("MLX arrays (RAM tier + live states)",
         [float(s.ram_arrays + s.live_arrays) for s in samples]),
        ("MLX active MB", [s.mlx_active / 2**20 for s in samples])]
    for ax, (title, ys) in zip(axes.flat, series, strict=True):
        if title.startswith("resident") and samples and samples[0].parts:
            ax.plot(t, ys, label="total")  # and its parts (memory_parts)
            for part in samples[0].parts:
                ax.plot(t, [s.parts.get(part, 0) / 2**20 for s in samples], label=part,
                        linewidth=0.8)
            ax.legend(fontsize="small", ncol=2)
        elif ys is None:
            ax.plot(t, [s.threads for s in samples], label="threads")
            ax.plot(t, [s.fds for s in samples], label="fds")
            ax.legend()
        else:
            ax.plot(t, ys)
        ax.set_title(title)
    for ax in axes[1]:
        ax.set_xlabel("minutes")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def run_soak(system: str, model: str, work_dir: Path, log_dir: Path, *, streams: int = 8,
             minutes: float | None = 30.0, rounds: int | None = None, max_tokens: int = 16,
             ram_budget: str = "64MB", redis: bool = False, extra_args: Sequence[str] = (),
             warmup: float = 0.25, progress: Callable[[str], None] | None = None
             ) -> dict[str, Any]:
    """One system's soak (a fresh cache folder under ``work_dir``): its samples,
    ``summarize``'s summary and the hit tokens by tier, or an ``error``."""
    t0 = time.monotonic()

    def each(s: Sample) -> None:
        if progress is not None and s.round % 20 == 0:
            progress(f"soak/{system} [{time.monotonic() - t0:7.1f} s] round {s.round}: rss "
                     f"{s.rss / 2**20:.0f} MB, threads {s.threads}, fds {s.fds}, arrays "
                     f"{s.ram_arrays + s.live_arrays}, requests {s.requests}, 5xx "
                     f"{s.errors_5xx}, refused {s.refused}")

    out: dict[str, Any] = {"streams": streams, "ram_budget": ram_budget, "redis": redis,
                           "samples": []}
    log_dir.mkdir(parents=True, exist_ok=True)
    args = ["--ram-budget", ram_budget, *extra_args]
    shared: RedisServer | None = None
    try:
        if redis:
            shared = RedisServer(work_dir / f"soak-{system}-redis").start()
            args += ["--redis-url", shared.url, "--ssd-budget", ram_budget]
        with server(model, log_dir / f"soak-{system}.log", cache_dir=work_dir / f"soak-{system}",
                    extra_args=args, system=system) as (base, pid):
            samples = run(base, pid, streams=streams, rounds=rounds, minutes=minutes,
                          max_tokens=max_tokens, on_sample=each)
            stats = httpx.get(f"{base}/v1/cache/stats", timeout=60).json()
    except (RuntimeError, AssertionError, httpx.HTTPError, psutil.Error) as e:
        out["error"] = f"{type(e).__name__}: {e}"[:500]
        return out
    finally:
        if shared is not None:
            shared.stop()
    out["hit_tokens_by_tier"] = {str(k): int(v) for k, v in
                                 ((stats.get("cache") or {}).get("hit_tokens_by_tier") or {}).items()}
    out["samples"] = [s.as_dict() for s in samples]
    out["summary"] = summarize(samples, warmup)
    return out
