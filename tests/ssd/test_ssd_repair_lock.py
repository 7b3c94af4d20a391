"""Repairs happen only under the folder's exclusive lock (issue 23).

No lock -> no repair: the tier serves read-only (or is off without a usable index)
and never deletes a file it cannot prove orphaned. ``cache check`` without ``--fix``
changes nothing on disk; ``check --fix`` on a corrupt index keeps every block file.

The lock failing to open is injected at its seam (``ssd_files.open_lock_fd``): the
tests run as root, where file permissions would not stop the open.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from ssd_helpers import NS, NS_BOB, chain, make_tier, payload_for

from promptcache.cli import main
from promptcache.errors import TierError
from promptcache.tiers import ssd_files

N_ALICE, N_BOB = 3, 2


def populate(root: Path) -> list:  # type: ignore[type-arg]
    ms = chain(NS, N_ALICE) + chain(NS_BOB, N_BOB)
    tier = make_tier(root)
    for i, m in enumerate(ms):
        tier.put(m, payload_for(i))
    tier.close()
    return ms


def block_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*.safetensors"))


def snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``root`` (SQLite's -wal / -shm aside): size and content."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_file()
            and not p.name.endswith(("-wal", "-shm"))}


def corrupt_index(root: Path) -> None:
    for suffix in ("-wal", "-shm"):
        Path(str(root / "index.sqlite") + suffix).unlink(missing_ok=True)
    (root / "index.sqlite").write_bytes(b"this is not a database" * 100)


def no_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(path: Path, *, create: bool) -> int:
        raise OSError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(ssd_files, "open_lock_fd", refuse)


def test_without_the_lock_the_tier_serves_read_only_and_repairs_nothing(tmp_path, monkeypatch):
    ms = populate(tmp_path)
    # damage a reconcile would repair: a row without its file, an orphan file
    gone = tmp_path / ssd_files.block_rel_path(ms[0].namespace_key, ms[0].tenant,
                                               ms[0].block_hash.hex())
    gone.unlink()
    orphan = gone.parent / ("ab" * 32 + ".safetensors")
    orphan.write_bytes(payload_for(9))
    before = snapshot(tmp_path)
    no_lock(monkeypatch)

    tier = make_tier(tmp_path)
    assert tier.mode == "read_only" and tier.startup_report is None
    s = tier.stats()
    assert (s["mode"], s["degraded"], s["blocks_on_disk"]) == ("read_only", True, N_ALICE + N_BOB)
    assert "folder lock" in s["mode_reason"] and "Permission denied" in s["mode_reason"]
    assert tier.health() == {"mode": "read_only", "degraded": True, "reason": s["mode_reason"],
                             "index_errors": 0}
    assert tier.get(ms[1].block_hash) == payload_for(1)  # reads are served
    fresh = chain(NS, N_ALICE + 1)[-1]
    assert tier.put(fresh, payload_for(7)) is False
    assert tier.stats()["dropped_spills"]["read_only"] == 1
    rep = tier.check(fix=True)
    assert rep.fixed is False and rep.refused is not None and "read-only" in rep.refused
    assert (rep.missing_files, rep.orphan_files) == (1, 1)  # found, not repaired
    assert tier.sweep() == 0
    with pytest.raises(TierError, match="read-only"):
        tier.delete_session("s1")
    with pytest.raises(TierError, match="read-only"):
        tier.purge()
    with pytest.raises(TierError, match="read-only"):
        tier.discard([ms[1].block_hash])
    assert tier.pin([ms[1].block_hash], 60.0) == 0
    tier.close()
    assert snapshot(tmp_path) == before  # not one file changed, moved or removed


def test_missing_file_read_without_the_lock_is_a_miss_that_moves_nothing(tmp_path, monkeypatch):
    ms = populate(tmp_path)
    p = tmp_path / ssd_files.block_rel_path(ms[1].namespace_key, ms[1].tenant,
                                            ms[1].block_hash.hex())
    p.write_bytes(p.read_bytes()[:-1] + b"\x00")  # corrupt: a checksum mismatch
    before = snapshot(tmp_path)
    no_lock(monkeypatch)
    tier = make_tier(tmp_path)
    with pytest.raises(Exception, match="checksum"):
        tier.get(ms[1].block_hash)
    s = tier.stats()
    assert (s["corrupt"], s["quarantined"], s["blocks_on_disk"]) == (1, 0, N_ALICE + N_BOB)
    tier.close()
    assert snapshot(tmp_path) == before


def test_corrupt_index_without_the_lock_is_off_and_keeps_every_file(tmp_path, monkeypatch):
    populate(tmp_path)
    corrupt_index(tmp_path)
    before = snapshot(tmp_path)
    no_lock(monkeypatch)
    tier = make_tier(tmp_path)
    assert tier.mode == "off" and tier.startup_report is None
    assert "not repairing" in tier.stats()["mode_reason"]
    rep = tier.check(fix=True)
    assert (rep.fixed, rep.unindexed_files, rep.orphan_files, rep.blocks) == (
        False, N_ALICE + N_BOB, 0, 0)
    assert rep.refused is not None and "off" in rep.refused
    tier.close()
    assert snapshot(tmp_path) == before
    assert len(block_files(tmp_path)) == N_ALICE + N_BOB


def test_unopenable_index_is_off_not_rebuilt(tmp_path, monkeypatch):
    """An index that cannot be opened (not proven corrupt) is never moved aside."""
    import sqlite3

    from promptcache.tiers import ssd_index

    populate(tmp_path)
    before = snapshot(tmp_path)
    real_connect = sqlite3.connect

    def unopenable(*args: object, **kw: object) -> sqlite3.Connection:
        if str(args[0]).endswith("index.sqlite"):
            raise sqlite3.OperationalError("unable to open database file")
        return real_connect(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(ssd_index.sqlite3, "connect", unopenable)
    tier = make_tier(tmp_path)
    assert tier.mode == "off" and "cannot open the index" in tier.stats()["mode_reason"]
    tier.close()
    monkeypatch.setattr(ssd_index.sqlite3, "connect", real_connect)
    assert snapshot(tmp_path) == before


def test_lock_file_opened_read_only_when_it_cannot_be_opened_for_writing(tmp_path, monkeypatch):
    """A lock file another user owns (EACCES on O_RDWR) still locks: flock works on a
    read-only descriptor, so the tier keeps its repairs."""
    populate(tmp_path)
    real_open = os.open

    def no_rdwr(path: object, flags: int, *args: object) -> int:
        if str(path).endswith("/lock") and flags & os.O_RDWR:
            raise OSError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(ssd_files.os, "open", no_rdwr)
    tier = make_tier(tmp_path)
    assert tier.mode == "read_write" and tier.startup_report is not None
    assert tier.startup_report.problems == 0
    tier.close()


def test_cache_check_without_fix_changes_nothing_on_a_corrupt_index(tmp_path, capsys):
    ms = populate(tmp_path)
    corrupt_index(tmp_path)
    stale = tmp_path / ssd_files.block_rel_path(ms[0].namespace_key, ms[0].tenant, "cd" * 32)
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(payload_for(8))
    before = snapshot(tmp_path)

    assert main(["cache", "check", "--cache-dir", str(tmp_path)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert (out["index_corrupt"], out["unindexed_files"], out["orphan_files"], out["fixed"]) == (
        True, N_ALICE + N_BOB + 1, 0, False)
    assert main(["cache", "stats", "--cache-dir", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["mode"] == "off"
    assert main(["cache", "ls", "--cache-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    assert snapshot(tmp_path) == before  # no quarantine move, no delete, no new index
    assert not (tmp_path / "quarantine").exists()

    # --fix rebuilds the index and keeps every block file (set aside, not deleted)
    assert main(["cache", "check", "--fix", "--cache-dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["index_rebuilt"], out["set_aside_files"], out["orphan_files"], out["blocks"]) == (
        True, N_ALICE + N_BOB + 1, 0, 0)
    aside = sorted(p.name for p in (tmp_path / "quarantine").glob("unindexed.*/**/*.safetensors"))
    assert aside == sorted([m.block_hash.hex() + ".safetensors" for m in ms] + [stale.name])
    assert main(["cache", "check", "--cache-dir", str(tmp_path)]) == 0


def test_cache_check_without_fix_changes_nothing_on_a_damaged_folder(tmp_path, capsys):
    ms = populate(tmp_path)
    p = tmp_path / ssd_files.block_rel_path(ms[0].namespace_key, ms[0].tenant,
                                            ms[0].block_hash.hex())
    p.write_bytes(p.read_bytes()[:5])  # wrong size
    orphan = p.parent / ("ef" * 32 + ".safetensors")
    orphan.write_bytes(payload_for(9))
    before = snapshot(tmp_path)
    assert main(["cache", "check", "--cache-dir", str(tmp_path)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert (out["wrong_size"], out["orphan_files"], out["blocks"]) == (1, 1, N_ALICE + N_BOB)
    assert snapshot(tmp_path) == before


def test_cache_check_fix_without_the_lock_exits_2_and_changes_nothing(tmp_path, capsys,
                                                                    monkeypatch):
    ms = populate(tmp_path)
    orphan = tmp_path / ssd_files.block_rel_path(ms[0].namespace_key, ms[0].tenant, "ab" * 32)
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(payload_for(9))
    before = snapshot(tmp_path)
    no_lock(monkeypatch)
    assert main(["cache", "check", "--fix", "--cache-dir", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out)["orphan_files"] == 1
    assert "no repair" in captured.err
    assert snapshot(tmp_path) == before
