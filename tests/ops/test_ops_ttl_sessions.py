"""TTL in RAM and on the SSD under one clock the test controls; session TTL (the reaper);
session listing and deletion from the CLI, on a folder and on a running server."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from promptcache.cache import PromptCache
from promptcache.cli import build_parser
from promptcache.cli.serve_cmd import build_configs
from promptcache.config import CacheConfig, SSDConfig
from promptcache.meta import Namespace
from promptcache.sessions import SessionReaper
from promptcache.tiers.ssd import SSDTier

BS = 4
NS = Namespace("model-a", BS, tenant="alice")
TTL = 100.0


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def payload_for(start: int, end: int, snapshot: bool) -> dict[str, np.ndarray]:
    return {"0.k": np.arange(start, end, dtype=np.float32).reshape(1, 1, -1, 1)}


def make(tmp: Path, clock: Clock, *, ttl: float | None = TTL) -> PromptCache:
    tier = SSDTier(SSDConfig(path=tmp / "ssd", fsync=False, ttl_seconds=ttl), clock=clock,
                   sweep_interval_s=1e9)
    return PromptCache(CacheConfig(block_size=BS, ram_budget_bytes=1 << 20, ttl_seconds=ttl),
                       lower=[tier], write_through=True, clock=clock)


SEQ = list(range(10, 22))  # 3 full blocks


def _hit(cache: PromptCache, tokens: list[int], session: str | None = None) -> tuple[int, dict]:  # type: ignore[type-arg]
    hit = cache.acquire(tokens, NS, session_id=session)
    cache.release(hit)
    return hit.num_tokens, dict(hit.tokens_by_tier)


def test_ttl_expires_blocks_in_ram_and_on_the_ssd(tmp_path: Path) -> None:
    clock = Clock()
    cache = make(tmp_path, clock)
    cache.store(NS, SEQ, 12, payload_for)
    assert cache.flush(30)
    ssd = cache.lower[0]
    clock.advance(TTL - 1)  # still fresh in RAM (and a hit refreshes RAM's last use)
    assert _hit(cache, SEQ + [1]) == (12, {"ram": 12})
    clock.advance(TTL - 1)  # RAM was used 99 s ago: fresh; the SSD copy is 198 s old
    assert _hit(cache, SEQ + [1]) == (12, {"ram": 12})
    assert ssd.get_metas([b.block_hash for b in cache.lookup(SEQ, NS).blocks], ns=NS) == \
        [None, None, None]  # expired on the SSD (its TTL counts from its last use there)
    clock.advance(TTL + 1)  # now RAM has expired too
    n, _ = _hit(cache, SEQ + [1])
    assert n == 0
    s = cache.stats()
    assert s.expired == 3 and s.misses_by_cause == {"expired": 1} and s.ram_blocks == 0
    assert ssd.sweep() == 3  # the sweep deletes the expired files
    assert ssd.stats()["evictions_ttl"] == 3 and ssd.stats()["blocks_on_disk"] == 0
    cache.close(persist=False)


def test_ttl_on_the_ssd_alone_and_a_read_extends_it(tmp_path: Path) -> None:
    clock = Clock()
    cache = make(tmp_path, clock)
    cache.store(NS, SEQ, 12, payload_for)
    other = list(range(40, 48))
    cache.store(NS, other, 8, payload_for)
    assert cache.flush(30)
    cache.evict()  # both chains live only on the SSD now
    clock.advance(TTL - 10)
    assert _hit(cache, SEQ + [1]) == (12, {"ssd": 12})  # promoted: read, so touched
    cache.evict()
    cache.lower[0].sweep()  # applies the batched touches
    clock.advance(20)  # 110 s after the writes, 20 s after SEQ was read
    assert _hit(cache, SEQ + [1]) == (12, {"ssd": 12})
    assert _hit(cache, other + [1])[0] == 0  # never read again: expired
    cache.close(persist=False)


def test_no_ttl_keeps_everything(tmp_path: Path) -> None:
    clock = Clock()
    cache = make(tmp_path, clock, ttl=None)
    cache.store(NS, SEQ, 12, payload_for)
    clock.advance(10 * 365 * 86400)
    assert _hit(cache, SEQ + [1]) == (12, {"ram": 12})
    cache.close(persist=False)


def test_session_ttl_reaps_idle_sessions_in_every_tier(tmp_path: Path) -> None:
    clock = Clock()
    cache = make(tmp_path, clock, ttl=None)
    shared = list(range(60, 64))
    cache.store(NS, shared + [1, 2, 3, 4], 8, payload_for, session_id="a")
    cache.store(NS, shared + [5, 6, 7, 8], 8, payload_for, session_id="b")
    cache.store(NS, list(range(80, 88)), 8, payload_for, session_id="old")  # seen by no one
    assert cache.flush(30)
    reaper = SessionReaper(cache, 3600, clock=clock)
    reaper.touch("alice", "a")
    reaper.touch("alice", "b")
    rows = {r["session_id"]: r for r in cache.sessions("alice")}
    assert set(rows) == {"a", "b", "old"}
    assert rows["a"]["tiers"]["ram"]["blocks"] == 2 and rows["a"]["tiers"]["ssd"]["blocks"] == 2
    assert rows["old"]["tiers"]["ssd"]["last_use"] == clock.t
    clock.advance(1800)
    reaper.touch("alice", "b")
    assert reaper.sweep() == 0
    clock.advance(1801)  # a: 3601 s idle, old: 3601 s (its blocks' last use), b: 1801 s
    assert [(t, s) for t, s, _ in reaper.idle()] == [("alice", "a"), ("alice", "old")]
    assert reaper.sweep() == 2
    assert {r["session_id"] for r in cache.sessions()} == {"b"}
    # the shared block stays (b still uses it), a's own block and old's are gone everywhere
    assert _hit(cache, shared + [5, 6, 7, 8, 9]) == (8, {"ram": 8})
    assert _hit(cache, shared + [1, 2, 3, 4, 9])[0] == 4
    assert _hit(cache, list(range(80, 89)))[0] == 0
    ssd = cache.lower[0]
    assert ssd.stats()["blocks_on_disk"] == 2  # the shared block + b's own
    assert reaper.snapshot()["reaped_sessions"] == 2
    cache.close(persist=False)
    with pytest.raises(ValueError):
        SessionReaper(cache, 0)


def _configs(*argv: str):  # type: ignore[no-untyped-def]
    return build_configs(build_parser().parse_args(["serve", *argv]))


def test_serve_ttl_options(tmp_path: Path) -> None:
    _, cache, ssd, srv = _configs("--ttl", "12h", "--session-ttl", "7d", "--cache-dir",
                                  str(tmp_path))
    assert cache.ttl_seconds == 12 * 3600 and ssd is not None and ssd.ttl_seconds == 12 * 3600
    assert srv.session_ttl_s == 7 * 86400
    _, cache, ssd, srv = _configs("--cache-dir", str(tmp_path))
    assert (cache.ttl_seconds, ssd.ttl_seconds, srv.session_ttl_s) == (None, None, None)
    for bad in (("--ttl", "soon"), ("--session-ttl", "0s")):
        with pytest.raises(ValueError):
            _configs(*bad, "--cache-dir", str(tmp_path))


def test_sessions_cli_on_a_folder(tmp_path: Path) -> None:
    from server_proc import PROMPTCACHE

    clock = Clock()
    cache = make(tmp_path, clock, ttl=None)
    cache.store(NS, list(range(100, 112)), 12, payload_for, session_id="chat-1")
    cache.store(NS, list(range(200, 208)), 8, payload_for, session_id="chat-2")
    cache.store(NS.with_tenant("bob"), list(range(200, 208)), 8, payload_for,
                session_id="chat-2")
    cache.close()  # persisted
    folder = str(tmp_path / "ssd")

    def cli(*a: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([PROMPTCACHE, "cache", "sessions", "--cache-dir", folder, *a],
                              capture_output=True, text=True, timeout=120)

    out = json.loads(cli("--json").stdout)["sessions"]
    assert sorted((r["tenant"], r["session_id"], r["blocks"]) for r in out) == [
        ("alice", "chat-1", 3), ("alice", "chat-2", 2), ("bob", "chat-2", 2)]
    assert all(r["last_use"] == clock.t and r["tiers"]["ssd"]["bytes"] > 0 for r in out)
    table = cli().stdout
    assert "chat-1" in table and "3 session(s)" in table
    done = cli("--delete", "chat-2", "--tenant", "alice")
    assert done.returncode == 0 and json.loads(done.stdout)["deleted_blocks"] == 2
    out = json.loads(cli("--json").stdout)["sessions"]
    assert sorted((r["tenant"], r["session_id"]) for r in out) == [("alice", "chat-1"),
                                                                   ("bob", "chat-2")]
    assert cli("--tenant", "bad tenant").returncode == 2
