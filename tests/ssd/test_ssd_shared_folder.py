"""One folder, several live tiers (as several server processes would have): a repair
leaves a live writer's temp files alone, the advisory lock excludes repairs from
changes in flight, files are published without clobbering, and block/byte totals,
the budget and the write counters are the folder's, not one process's."""

from __future__ import annotations

import fcntl
import os
import time

import pytest
from ssd_helpers import NS, chain, dead_pid, make_tier, payload_for

from promptcache.tiers import ssd_files as files
from promptcache.tiers.ssd_files import DirLock, publish, temp_is_stale, write_temp
from promptcache.tiers.ssd_index import SSDIndex

SIZE = len(payload_for(0))


def block_folder(root, m):  # type: ignore[no-untyped-def]
    return root / files.block_rel_path(m.namespace_key, m.tenant, m.block_hash.hex()).rsplit("/", 1)[0]


def test_two_tiers_see_each_others_blocks_and_share_totals(tmp_path):
    a, b = make_tier(tmp_path), make_tier(tmp_path)
    ms = chain(NS, 5)
    for i in range(3):
        assert a.put(ms[i], payload_for(i))
    for i in range(3, 5):
        assert b.put(ms[i], payload_for(i))
    a.flush()
    b.flush()
    for tier in (a, b):
        s = tier.stats()
        assert (s["blocks_on_disk"], s["bytes_on_disk"], s["bytes_written"]) == (5, 5 * SIZE, 5 * SIZE)
        assert [tier.get(m.block_hash) for m in ms] == [payload_for(i) for i in range(5)]
    assert a.check().problems == 0 and b.check().problems == 0
    a.close()
    b.close()


def test_the_budget_holds_for_all_writers_together(tmp_path):
    a = make_tier(tmp_path, budget_bytes=4 * SIZE)
    b = make_tier(tmp_path, budget_bytes=4 * SIZE)
    ms = chain(NS, 6)
    for i, m in enumerate(ms):  # alternate writers
        tier = a if i % 2 == 0 else b
        assert tier.put(m, payload_for(i))
        tier.flush()
    for tier in (a, b):
        s = tier.stats()
        assert (s["blocks_on_disk"], s["bytes_on_disk"]) == (4, 4 * SIZE)
    assert a.stats()["evictions_capacity"] + b.stats()["evictions_capacity"] == 2
    files_left = [p for p in tmp_path.rglob("*.safetensors") if "quarantine" not in p.parts]
    assert len(files_left) == 4
    a.close()
    b.close()


def test_a_repair_leaves_a_live_writers_temp_files_alone(tmp_path):
    a = make_tier(tmp_path)
    m = chain(NS, 1)[0]
    a.put(m, payload_for(0))
    a.flush()
    folder = block_folder(tmp_path, m)
    live = write_temp(folder, "x.safetensors", b"in flight", fsync=False)  # our pid: alive
    assert f".{os.getpid()}." in live.name
    dead = folder / f"{files.TEMP_PREFIX}y.safetensors.{dead_pid()}.0123abcd"
    dead.write_bytes(b"left by a killed writer")
    old = folder / f"{files.TEMP_PREFIX}z.safetensors.{os.getpid()}.4567abcd"
    old.write_bytes(b"too old to be in flight")
    os.utime(old, (time.time() - 2 * files.STALE_TEMP_S,) * 2)
    b = make_tier(tmp_path)  # a second server opens the folder: its startup repair
    assert b.startup_report is not None and b.startup_report.temp_files == 2
    assert live.exists() and not dead.exists() and not old.exists()
    assert b.check(fix=False).problems == 0  # a live temp file is not a problem
    assert b.get(m.block_hash) == payload_for(0)
    live.unlink()
    a.close()
    b.close()


def test_temp_is_stale_rules(tmp_path):
    p = tmp_path / f"{files.TEMP_PREFIX}a.{os.getpid()}.00ff"
    p.write_bytes(b"")
    assert temp_is_stale(p) is False
    assert temp_is_stale(p, now=time.time() + 2 * files.STALE_TEMP_S) is True
    q = tmp_path / f"{files.TEMP_PREFIX}a.{dead_pid()}.00ff"
    q.write_bytes(b"")
    assert temp_is_stale(q) is True
    r = tmp_path / f"{files.TEMP_PREFIX}no-pid-here"
    r.write_bytes(b"")
    assert temp_is_stale(r) is False  # not ours: by age only
    assert temp_is_stale(tmp_path / "gone") is False


def test_the_folder_lock_excludes_a_repair_while_a_change_is_in_flight(tmp_path):
    lock = DirLock(tmp_path / files.LOCK_NAME)
    probe = os.open(tmp_path / files.LOCK_NAME, os.O_RDWR)
    try:
        with lock.shared():  # a write between publishing and committing
            fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)  # other changes may run
            fcntl.flock(probe, fcntl.LOCK_UN)
            with pytest.raises(BlockingIOError):  # a repair may not
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with lock.exclusive():  # a repair: nothing else
            with pytest.raises(BlockingIOError):
                fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released
        fcntl.flock(probe, fcntl.LOCK_UN)
    finally:
        os.close(probe)
        lock.close()


def test_a_tier_holds_the_folder_lock_while_it_publishes_and_commits(tmp_path, monkeypatch):
    tier = make_tier(tmp_path)
    probe = os.open(tmp_path / files.LOCK_NAME, os.O_RDWR)
    seen: list[str] = []
    real_publish = files.publish

    def spy(tmp, names, *, fsync):  # type: ignore[no-untyped-def]
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(probe, fcntl.LOCK_UN)
            seen.append("unlocked")
        except BlockingIOError:
            seen.append("locked")
        return real_publish(tmp, names, fsync=fsync)

    monkeypatch.setattr(files, "publish", spy)
    tier.put(chain(NS, 1)[0], payload_for(0))
    tier.flush()
    assert seen == ["locked"]
    os.close(probe)
    tier.close()


def test_publish_never_replaces_a_file(tmp_path):
    names = ["b.safetensors", "b.1.safetensors"]
    t1 = write_temp(tmp_path, names[0], b"one", fsync=False)
    assert publish(t1, names, fsync=False) == names[0]
    t2 = write_temp(tmp_path, names[0], b"two", fsync=False)
    assert publish(t2, names, fsync=False) == names[1]  # the primary is taken
    t3 = write_temp(tmp_path, names[0], b"three", fsync=False)
    third = publish(t3, names, fsync=False)  # both taken: a fresh name
    assert third.startswith("b.") and third.endswith(".safetensors") and third not in names
    assert [(tmp_path / n).read_bytes() for n in (*names, third)] == [b"one", b"two", b"three"]
    assert list(tmp_path.glob(".tmp-*")) == []


def test_two_writers_of_one_block_never_leave_a_row_without_its_bytes(tmp_path):
    a, b = make_tier(tmp_path), make_tier(tmp_path)
    m = chain(NS, 1)[0]
    for round_ in range(5):  # both rewrite the same block, different bytes each time
        assert a.put(m, payload_for(10 + round_))
        assert b.put(m, payload_for(20 + round_))
        a.flush()
        b.flush()
        got = a.get(m.block_hash)
        assert got in (payload_for(10 + round_), payload_for(20 + round_))
        assert b.get(m.block_hash) == got
        assert a.check(fix=False).problems == 0
        left = [p for p in tmp_path.rglob("*.safetensors") if "quarantine" not in p.parts]
        assert len(left) == 1  # the replaced file was removed after the commit
    assert a.stats()["corrupt"] == b.stats()["corrupt"] == 0
    a.close()
    b.close()


def test_a_version_1_index_is_upgraded_with_its_totals(tmp_path):
    tier = make_tier(tmp_path)
    ms = chain(NS, 3)
    for i, m in enumerate(ms):
        tier.put(m, payload_for(i))
    tier.close()
    idx = SSDIndex(tmp_path / files.INDEX_NAME, durable=False)
    for stmt in ("DROP TRIGGER totals_insert", "DROP TRIGGER totals_delete",
                 "DROP TRIGGER totals_update", "DROP TABLE totals"):
        idx._db.execute(stmt)
    idx.kv_set("schema_version", "1")
    idx.close()
    tier = make_tier(tmp_path)
    s = tier.stats()
    assert (s["blocks_on_disk"], s["bytes_on_disk"]) == (3, 3 * SIZE)
    assert tier.discard([ms[0].block_hash]) == 1
    assert tier.stats()["blocks_on_disk"] == 2
    assert tier.check(fix=False).problems == 0
    tier.close()
