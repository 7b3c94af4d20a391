"""The SSD tier's boundary: whatever fails underneath (one SQLite index method at a
time — "database is locked" —, or one file operation at a time — EIO), every
public method either answers or raises ``TierError``; and a PromptCache over such
a tier serves the request as a miss with nothing left pinned."""

from __future__ import annotations

import errno
import sqlite3
from typing import Any

import numpy as np
import pytest
from ssd_helpers import NS, chain, make_tier, payload_for

from promptcache.cache import PromptCache
from promptcache.config import CacheConfig
from promptcache.errors import TierError
from promptcache.tiers import ssd_files
from promptcache.tiers.ssd_index import SSDIndex

INDEX_METHODS = [
    "begin", "commit", "rollback", "kv_get", "kv_set", "get", "children", "child_reads",
    "upsert", "delete", "touch", "totals", "recount", "add_written", "written", "iter_rows",
    "files", "lru", "expired", "select_files", "add_sessions", "remove_session",
    "sessions_of", "sessions", "tenants", "pin", "pinned", "count", "quick_check",
    "names_segment", "segment_use", "move",
]
FILE_FUNCTIONS = ["ensure_dir", "write_temp", "publish", "fsync_dir", "remove_file",
                  "quarantine", "scan", "read_verified"]


def test_every_index_method_is_listed():
    public = {n for n in vars(SSDIndex) if not n.startswith("_")} - {"close", "child_files"}
    assert public == set(INDEX_METHODS)


class FailingIndex:
    """Delegates to the real index; ``method`` raises "database is locked"."""

    def __init__(self, real: SSDIndex, method: str) -> None:
        self._real = real
        self._method = method

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if name == self._method:
            def fail(*args: Any, **kw: Any) -> Any:
                raise sqlite3.OperationalError("database is locked")
            return fail
        return attr


def exercise(tier, ms) -> list[str]:  # type: ignore[no-untyped-def]
    """Call every public method; return the names that raised TierError. Anything
    else propagates and fails the test."""
    raised: list[str] = []
    fresh = chain(NS, 6)[4:]

    def call(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        try:
            fn()
        except TierError:
            raised.append(name)

    call("get_meta", lambda: tier.get_meta(ms[0].block_hash))
    call("children", lambda: tier.children(ms[0].block_hash))
    call("get", lambda: tier.get(ms[1].block_hash))
    call("sessions_of", lambda: tier.sessions_of(ms[0].block_hash))
    call("add_sessions", lambda: tier.add_sessions(ms[0].block_hash, ["t"]))
    call("put", lambda: tier.put(fresh[0], payload_for(4), ["s"]))
    call("has_room", lambda: tier.has_room())
    call("flush", lambda: tier.flush(timeout=30))
    call("stats", lambda: tier.stats())
    call("rows", lambda: tier.rows())
    call("tenants", lambda: tier.tenants())
    call("sessions", lambda: tier.sessions())
    call("sweep", lambda: tier.sweep())
    call("pin", lambda: tier.pin([ms[0].block_hash, fresh[1].block_hash], 86400.0))
    call("discard", lambda: tier.discard([ms[2].block_hash]))
    call("delete_session", lambda: tier.delete_session("s", tenant=NS.tenant))
    call("purge", lambda: tier.purge(older_than_s=10**9))
    call("delete_tenant", lambda: tier.delete_tenant("nobody"))
    call("check", lambda: tier.check(fix=True))
    return raised


def stored_tier(tmp_path):  # type: ignore[no-untyped-def]
    tier = make_tier(tmp_path)
    ms = chain(NS, 4)
    for i, m in enumerate(ms):
        tier.put(m, payload_for(i), ["s"])
    tier.flush()
    return tier, ms


@pytest.mark.parametrize("method", INDEX_METHODS)
def test_an_index_failure_leaves_only_tier_errors(tmp_path, method):
    tier, ms = stored_tier(tmp_path)
    real = tier.catalog.index
    tier.catalog.index = FailingIndex(real, method)  # type: ignore[assignment]
    exercise(tier, ms)
    tier.catalog.index = real
    tier.flush(timeout=30)  # the writer thread survived it
    assert tier._thread.is_alive()
    tier.close()


@pytest.mark.parametrize("function", FILE_FUNCTIONS)
def test_a_file_operation_failure_leaves_only_tier_errors(tmp_path, monkeypatch, function):
    tier, ms = stored_tier(tmp_path)

    def eio(*args: Any, **kw: Any) -> Any:
        raise OSError(errno.EIO, "Input/output error")

    # corrupt one block so quarantine is reached too
    p = tmp_path / ssd_files.block_rel_path(ms[1].namespace_key, ms[1].tenant, ms[1].block_hash.hex())
    p.write_bytes(b"\0" * p.stat().st_size)
    monkeypatch.setattr(ssd_files, function, eio)
    exercise(tier, ms)
    monkeypatch.undo()
    tier.flush(timeout=30)
    assert tier._thread.is_alive()
    tier.close()


BS = 4


def np_payload(start: int, end: int, snapshot: bool) -> dict[str, np.ndarray]:
    return {"0.k": np.full((1, 1, end - start, 2), float(start), dtype=np.float32)}


@pytest.mark.parametrize("method", ["sessions_of", "get", "children", "begin", "totals"])
def test_a_locked_index_during_promotion_is_a_miss_that_pins_nothing(tmp_path, method):
    """The reported bug: "database is locked" inside promotion left blocks pinned."""
    ns = NS
    tier = make_tier(tmp_path)
    cache = PromptCache(CacheConfig(block_size=BS, ram_budget_bytes=1 << 20), lower=[tier])
    toks = list(range(100, 124))  # 6 blocks
    cache.store(ns, toks, len(toks), np_payload, session_id="s")
    cache.evict()
    tier.flush()
    real = tier.catalog.index
    tier.catalog.index = FailingIndex(real, method)  # type: ignore[assignment]
    hit = cache.acquire(toks + [0], ns)
    cache.release(hit)
    tier.catalog.index = real
    assert cache.pool.num_used_blocks == 0
    cache.check()
    if method in ("sessions_of", "get"):  # (children: only the partial tail needs it)
        assert hit.num_tokens == 0 and cache.stats().tier_errors >= 1
    again = cache.acquire(toks + [0], ns)  # the tier works again: a full hit
    assert again.num_tokens == 24
    cache.release(again)
    assert cache.pool.num_used_blocks == 0
    cache.close()
