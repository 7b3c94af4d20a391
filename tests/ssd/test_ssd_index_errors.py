"""A running tier notices index errors (issue 23): every SQLite error is counted
(``index_errors``) and degrades the tier; a damaged index file (found by a query or
by the periodic ``verify_index`` of the writer's sweep) turns the tier read-only:
no writes and no repairs on an index that cannot be trusted, reads still verified
by their checksums. Errors are injected at the index seam, or the index file is
damaged on disk; nothing depends on timing (the check interval is 0 or never).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from ssd_helpers import NS, FakeClock, chain, make_tier, payload_for

from promptcache.tiers.ssd_index import SSDIndex
from promptcache.tiers.ssd_schema import is_corruption

NEVER = 1e9


class FailingIndex:
    """Delegates to the real index; ``method`` raises ``error``."""

    def __init__(self, real: SSDIndex, method: str, error: sqlite3.Error) -> None:
        self._real, self._method, self._error = real, method, error

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if name == self._method:
            def fail(*args: Any, **kw: Any) -> Any:
                raise self._error
            return fail
        return attr


def stored(root: Path, **kw: Any):  # type: ignore[no-untyped-def]
    tier = make_tier(root, clock=FakeClock(), sweep_interval_s=NEVER, **kw)
    ms = chain(NS, 3)
    for i, m in enumerate(ms):
        tier.put(m, payload_for(i))
    tier.flush()
    return tier, ms


def malformed() -> sqlite3.DatabaseError:
    return sqlite3.DatabaseError("database disk image is malformed")


def damage_index(root: Path) -> None:
    """Every page of the index file after its 100-byte header overwritten (a fixed
    pattern), once the WAL is checkpointed into it (else SQLite reads the WAL's pages)."""
    with sqlite3.connect(root / "index.sqlite") as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    idx = root / "index.sqlite"
    data = bytearray(idx.read_bytes())
    data[100:] = (bytes(range(256)) * (len(data) // 256 + 1))[: len(data) - 100]
    idx.write_bytes(bytes(data))


def test_corruption_classification():
    assert is_corruption(malformed())
    assert is_corruption(sqlite3.DatabaseError("file is not a database"))
    assert not is_corruption(sqlite3.OperationalError("database is locked"))
    assert not is_corruption(sqlite3.OperationalError("disk I/O error"))
    assert not is_corruption(sqlite3.IntegrityError("UNIQUE constraint failed"))
    assert not is_corruption(OSError("x"))


def test_damaged_index_file_is_noticed_by_the_sweep(tmp_path):
    tier, ms = stored(tmp_path, index_check_interval_s=0.0)
    assert tier.verify_index() is True and tier.health()["index_errors"] == 0
    damage_index(tmp_path)

    tier.sweep()  # the writer's periodic sweep (interval 0: verifies every time)
    h = tier.health()
    assert (h["mode"], h["degraded"], h["index_errors"]) == ("read_only", True, 1)
    assert "index is corrupt" in h["reason"]
    assert tier.put(chain(NS, 4)[-1], payload_for(3)) is False  # no writes on it
    files = sorted(p.name for p in tmp_path.rglob("*.safetensors"))
    assert files == sorted(bytes(m.block_hash).hex() + ".safetensors" for m in ms)
    tier.close()


def test_verify_runs_only_when_due(tmp_path):
    tier, _ = stored(tmp_path, index_check_interval_s=NEVER)
    calls: list[int] = []
    tier.verify_index = lambda: calls.append(1) or True  # type: ignore[method-assign]
    tier.sweep()
    assert calls == []
    tier.maint.index_check_interval = 0.0
    tier.sweep()
    assert calls == [1]
    tier.close()


def test_damage_is_noticed_by_the_sweeps_own_queries_too(tmp_path):
    tier, _ = stored(tmp_path, index_check_interval_s=NEVER)
    damage_index(tmp_path)
    tier.sweep()
    h = tier.health()
    assert (h["mode"], h["index_errors"]) == ("read_only", 1)
    assert tier.verify_index() is False
    assert tier.health()["index_errors"] == 2
    tier.close()


def test_corruption_seen_by_a_query_makes_the_tier_read_only(tmp_path):
    tier, ms = stored(tmp_path)
    real = tier.catalog.index
    tier.catalog.index = FailingIndex(real, "get", malformed())  # type: ignore[assignment]
    assert tier.get_meta(ms[0].block_hash) is None  # a miss, never an exception
    s = tier.stats()
    assert (s["index_errors"], s["index_corrupt"], s["mode"], s["degraded"]) == (
        1, 1, "read_only", True)
    assert tier.put(chain(NS, 4)[-1], payload_for(3)) is False
    assert tier.stats()["dropped_spills"]["read_only"] == 1
    tier.catalog.index = real  # type: ignore[assignment]
    assert tier.get(ms[1].block_hash) == payload_for(1)  # reads go on, checksummed
    tier.close()


def test_other_index_errors_degrade_and_recover(tmp_path):
    clock = FakeClock()
    tier = make_tier(tmp_path, clock=clock, sweep_interval_s=NEVER, degraded_backoff_s=5)
    ms = chain(NS, 3)
    tier.put(ms[0], payload_for(0))
    tier.flush()
    real = tier.catalog.index
    tier.catalog.index = FailingIndex(real, "get", sqlite3.OperationalError("disk I/O error"))  # type: ignore[assignment]
    assert tier.get_meta(ms[0].block_hash) is None
    s = tier.stats()
    assert (s["index_errors"], s["index_corrupt"], s["mode"], s["degraded"]) == (
        1, 0, "read_write", True)
    tier.catalog.index = real  # type: ignore[assignment]
    clock.advance(6)
    assert tier.put(ms[1], payload_for(1)) is True
    tier.flush()
    s = tier.stats()
    assert (s["degraded"], s["index_errors"], s["spills"]) == (False, 1, 2)
    tier.close()


def test_read_ahead_index_error_is_counted_not_silent(tmp_path):
    tier, ms = stored(tmp_path, read_ahead_blocks=2)
    real = tier.catalog.index
    tier.catalog.index = FailingIndex(real, "child_reads", sqlite3.OperationalError("disk I/O error"))  # type: ignore[assignment]
    assert tier.get(ms[0].block_hash) == payload_for(0)  # the hint failed, the read did not
    assert tier.stats()["index_errors"] == 1
    tier.catalog.index = real  # type: ignore[assignment]
    tier.close()
