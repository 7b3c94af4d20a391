"""kill -9 real servers (tiny llama, write-through, block size 16, ~4k-token prompts).

``test_kill_9_cycles``: a server handling 4k-token prompts is killed at a random
moment — while starting, during prefill, during decode, idle, or during its clean
shutdown — again and again. After each kill: the index and the files agree (a kill
may leave only temp files and unindexed files, never a row without its bytes; the
repair then leaves ``cache check`` clean); every full block the index had committed
at any earlier moment is still there and verifies; and the restarted server's output
from restored blocks equals a full prefill (another tenant: no cache).

``test_two_live_servers_one_killed_repeatedly``: two servers on one folder under
concurrent traffic with overlapping 1k-token prompts and a shared byte budget small enough
that both evict each other's blocks; one of them is killed and restarted again and
again. Every response (from any server, any mix of cached tiers) equals the cold
reference output of its prompt, so no corrupt block is ever served; nothing is
quarantined; ``promptcache cache check`` (run while the other server is live) is
clean; the byte total is within the shared budget.

CI runs the short versions (5 cycles; 30 s of traffic). The long versions were run by
hand (commands and results in BENCHMARKS.md, "Durability runs"):
``PROMPTCACHE_SERVER_CRASH_CYCLES=50 PROMPTCACHE_SHARED_SERVERS_SECONDS=300
.venv/bin/pytest -q tests/ssd/test_ssd_server_crash.py``.
"""

from __future__ import annotations

import os
import random
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import httpx
from server_proc import PROMPTCACHE, Server, token_prompt

from promptcache.config import SSDConfig
from promptcache.tiers.ssd import SSDTier

CYCLES = int(os.environ.get("PROMPTCACHE_SERVER_CRASH_CYCLES", "5"))
SHARED_SECONDS = float(os.environ.get("PROMPTCACHE_SHARED_SERVERS_SECONDS", "30"))
BS = 16
ARGS = ("--block-size", str(BS), "--ssd-policy", "write_through")
BASE = token_prompt(3600, seed=1)


def conversation(turn: int) -> list[int]:
    """Turn ``turn`` of one conversation: the shared history plus 100 tokens a turn."""
    return BASE + token_prompt(100 * (turn + 1), seed=2)[: 100 * (turn + 1)]


def committed_full_blocks(folder: Path) -> dict[bytes, str]:
    """Full blocks the index has committed right now (read beside the live server)."""
    path = folder / "index.sqlite"
    if not path.exists():
        return {}
    db = sqlite3.connect(str(path), timeout=30)
    try:
        rows = db.execute("SELECT hash, checksum FROM blocks WHERE num_tokens = ?", (BS,)).fetchall()
    except sqlite3.OperationalError:  # not created yet
        return {}
    finally:
        db.close()
    return {bytes(h): str(c) for h, c in rows}


def verify_after_kill(folder: Path, known: dict[bytes, str]) -> int:
    """The folder as the next server will find it; returns the blocks on disk."""
    tier = SSDTier(SSDConfig(path=folder), reconcile_on_open=False)
    try:
        before = tier.check(fix=False)
        # a kill mid-write leaves at most temp files and files without a row
        assert (before.missing_files, before.wrong_size, before.index_rebuilt) == (0, 0, False)
        tier.check(fix=True)
        assert tier.check(fix=False).problems == 0
        for h in known:  # every block committed at any moment is there (its bytes may be
            # rewritten since: a restored prefix stored again from another chunk shape)
            meta = tier.get_meta(h)
            assert meta is not None, f"committed block {h.hex()[:16]} is gone"
            assert tier.get(h) is not None  # read and checksum-verified
        s = tier.stats()
        assert (s["corrupt"], s["quarantined"]) == (0, 0)
        return int(s["blocks_on_disk"])
    finally:
        tier.close()


def background_request(server: Server, prompt: list[int], max_tokens: int) -> threading.Thread:
    def run() -> None:
        try:
            server.complete(prompt, max_tokens=max_tokens, timeout=120)
        except (httpx.HTTPError, OSError):
            pass  # killed under it

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_kill_9_cycles(tiny_llama_path, tmp_path):
    rng = random.Random(20261201)
    folder = tmp_path / "blocks"
    known: dict[bytes, str] = {}
    checked_equal = 0
    for cycle in range(CYCLES):
        log = tmp_path / f"server-{cycle}.log"
        mode = ("startup", "prefill", "decode", "idle", "shutdown")[cycle % 5]
        if mode == "startup":  # killed before it answers (during import, load or reconcile)
            s = Server(tiny_llama_path, folder, log, *ARGS, ready=False)
            time.sleep(rng.uniform(0.5, 4.0))
            s.kill()
            verify_after_kill(folder, known)
            continue
        with Server(tiny_llama_path, folder, log, *ARGS) as s:
            # restored blocks (from earlier cycles) give the same output as a full prefill
            prompt = conversation(cycle % 4)
            warm = s.complete(prompt, max_tokens=6)
            cold = s.complete(prompt, max_tokens=6, tenant=f"cold-{cycle}")
            assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
            if warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0:
                checked_equal += 1
            s.wait_written()  # this turn is on disk: the next cycle's warm turn hits it
            known.update(committed_full_blocks(folder))
            nxt = conversation((cycle + 1) % 4)  # (turn 3: 4,000 tokens, the longest that fits)
            if mode == "shutdown":
                s.complete(nxt, max_tokens=4)
                s.proc.send_signal(15)  # SIGTERM: the clean shutdown starts ...
                time.sleep(rng.uniform(0.0, 1.0))
                known.update(committed_full_blocks(folder))
                s.kill()  # ... and is cut short
            else:
                if mode != "idle":  # a fresh 4k-token prompt: a long prefill to cut into
                    nxt = token_prompt(4000, seed=100 + cycle)
                saved = s.stats()["cache"]["saves"]["end_prefill"]
                t = background_request(s, nxt, max_tokens=2 if mode == "prefill" else 64)
                if mode == "decode":  # wait until the prompt is in (its prefill saved)
                    deadline = time.monotonic() + 60
                    while s.stats()["cache"]["saves"]["end_prefill"] == saved:
                        assert time.monotonic() < deadline, "prefill did not finish"
                        time.sleep(0.02)
                elif mode == "idle":
                    t.join(timeout=120)
                time.sleep(rng.uniform(0.0, 0.8))
                known.update(committed_full_blocks(folder))
                s.kill()
                t.join(timeout=30)
        blocks = verify_after_kill(folder, known)
        assert blocks >= len(known)
    assert len(known) > 0 and checked_equal > 0
    r = subprocess.run([PROMPTCACHE, "cache", "check", "--cache-dir", str(folder)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_two_live_servers_one_killed_repeatedly(tiny_llama_path, tmp_path):
    folder = tmp_path / "blocks"
    budget = 2 * 1024 * 1024  # ~4 of the 6 prompts fit: constant cross eviction
    args = (*ARGS, "--ssd-budget", str(budget))
    short = BASE[:1000]  # (1k-token prompts here: many requests in the time)
    prompts = [short + token_prompt(50 * (t + 1), seed=2) for t in range(3)] + \
        [token_prompt(1000, seed=9 + i) for i in range(3)]
    rng = random.Random(7)
    steady = Server(tiny_llama_path, folder, tmp_path / "steady.log", *args)
    victim = Server(tiny_llama_path, folder, tmp_path / "victim-0.log", *args)
    servers = {"steady": steady, "victim": victim}
    reference: dict[int, str] = {}
    for i, p in enumerate(prompts):  # cold references (a tenant of their own: no cache)
        reference[i] = steady.complete(p, max_tokens=6, tenant="reference")["choices"][0]["text"]
    stop = threading.Event()
    served: list[tuple[str, int, int]] = []  # (server, prompt, cached tokens)
    errors: list[str] = []

    def traffic(name: str, seed: int) -> None:
        r = random.Random(seed)
        while not stop.is_set():
            i = r.randrange(len(prompts))
            try:
                out = servers[name].complete(prompts[i], max_tokens=6, timeout=120)
            except (httpx.HTTPError, OSError):
                time.sleep(0.05)  # the victim is being killed or restarted
                continue
            if out["choices"][0]["text"] != reference[i]:
                errors.append(f"{name}: prompt {i} gave {out['choices'][0]['text']!r}")
            served.append((name, i, out["usage"]["prompt_tokens_details"]["cached_tokens"]))

    threads = [threading.Thread(target=traffic, args=(n, k), daemon=True)
               for k, n in enumerate(["steady", "steady", "victim", "victim"])]
    for t in threads:
        t.start()
    kills = 0
    try:
        deadline = time.monotonic() + SHARED_SECONDS
        while time.monotonic() < deadline or kills < 2:
            # let the (re)started victim serve something, then kill it at a random moment
            done = sum(1 for name, _, _ in served if name == "victim")
            limit = time.monotonic() + 300
            while sum(1 for name, _, _ in served if name == "victim") == done:
                assert time.monotonic() < limit, "the victim served nothing"
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 2.0))
            servers["victim"].kill()
            kills += 1
            servers["victim"] = Server(tiny_llama_path, folder, tmp_path / f"victim-{kills}.log",
                                       *args)
        stop.set()
        for t in threads:
            t.join(timeout=180)
        # blocks one server wrote are restored by the other: the steady server serves a
        # new prompt (its blocks are then the newest on the SSD: no capacity eviction
        # takes them), a fresh victim (empty RAM) asks for it again
        servers["victim"].kill()
        final = token_prompt(1000, seed=77)
        want = steady.complete(final, max_tokens=6, tenant="reference")["choices"][0]["text"]
        steady.complete(final, max_tokens=6)
        steady.wait_written()
        servers["victim"] = fresh = Server(tiny_llama_path, folder, tmp_path / "victim-last.log",
                                           *args)
        out = fresh.complete(final, max_tokens=6)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(final) - 1
        assert out["choices"][0]["text"] == want
        fresh.kill()
        # a repair and a check while the other server is live
        for argv in (["--fix"], []):
            r = subprocess.run([PROMPTCACHE, "cache", "check", "--cache-dir", str(folder), *argv],
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stdout + r.stderr
        st = steady.wait_written()
        ssd = st["tiers"]["ssd"]
        assert (ssd["corrupt"], ssd["quarantined"], ssd["degraded"]) == (0, 0, False)
        assert ssd["bytes_on_disk"] <= budget
        assert ssd["evictions_capacity"] > 0  # the references alone exceed the budget
        assert steady.stop() == 0
    finally:
        stop.set()
        for s in servers.values():
            if s.proc.poll() is None:
                s.kill()
    assert errors == []
    assert kills >= 2 and sum(1 for name, _, _ in served if name == "victim") >= kills
    tier = SSDTier(SSDConfig(path=folder, budget_bytes=budget), reconcile_on_open=False)
    try:
        assert tier.check(fix=False).problems == 0
        assert tier.stats()["bytes_on_disk"] <= budget
        assert not (folder / "quarantine").exists() or list((folder / "quarantine").iterdir()) == []
    finally:
        tier.close()
