"""Cause mayhem on disk: every kind of damage is detected, cleaned or quarantined,
and nothing but a counted miss / CorruptBlockError reaches the caller."""

import os
from pathlib import Path

import pytest
from ssd_helpers import NS, chain, dead_pid, make_tier, payload_for

from promptcache.errors import CorruptBlockError
from promptcache.tiers.ssd_files import block_rel_path

SIZE = len(payload_for(0))


def stored(tmp_path: Path, n: int = 3):
    tier = make_tier(tmp_path)
    ms = chain(NS, n)
    for i, m in enumerate(ms):
        tier.put(m, payload_for(i), ["s"])
    tier.flush()
    return tier, ms


def path_of(root: Path, m) -> Path:
    return root / block_rel_path(m.namespace_key, m.tenant, m.block_hash.hex())


def quarantined(root: Path) -> list[str]:
    q = root / "quarantine"
    return sorted(p.name for p in q.iterdir()) if q.exists() else []


def test_truncated_file_is_quarantined_on_read(tmp_path):
    tier, ms = stored(tmp_path)
    p = path_of(tmp_path, ms[1])
    p.write_bytes(p.read_bytes()[:-10])
    with pytest.raises(CorruptBlockError):
        tier.get(ms[1].block_hash)
    assert tier.get_meta(ms[1].block_hash) is None
    assert tier.get(ms[1].block_hash) is None  # now a plain miss
    assert not p.exists()
    q = quarantined(tmp_path)
    assert len(q) == 1 and q[0].startswith(ms[1].block_hash.hex()) and ".size." in q[0]
    s = tier.stats()
    assert (s["corrupt"], s["quarantined"], s["blocks_on_disk"], s["bytes_on_disk"]) == (
        1, 1, 2, 2 * SIZE,
    )
    assert tier.get(ms[0].block_hash) == payload_for(0)
    assert tier.check().problems == 0
    tier.close()


def test_flipped_byte_fails_the_checksum(tmp_path):
    tier, ms = stored(tmp_path)
    p = path_of(tmp_path, ms[2])
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))
    with pytest.raises(CorruptBlockError, match="checksum"):
        tier.get(ms[2].block_hash)
    assert ".checksum." in quarantined(tmp_path)[0]
    s = tier.stats()
    assert (s["corrupt"], s["quarantined"], s["misses"]) == (1, 1, 1)
    tier.close()


def test_deleted_file_is_a_counted_corrupt_miss(tmp_path):
    tier, ms = stored(tmp_path)
    path_of(tmp_path, ms[0]).unlink()
    with pytest.raises(CorruptBlockError, match="missing"):
        tier.get(ms[0].block_hash)
    s = tier.stats()
    assert (s["corrupt"], s["missing_files"], s["quarantined"], s["blocks_on_disk"]) == (1, 1, 0, 2)
    assert tier.get_meta(ms[0].block_hash) is None
    tier.close()


def test_reconcile_on_restart_finds_every_kind_of_damage(tmp_path):
    tier, ms = stored(tmp_path, 4)
    tier.close()
    path_of(tmp_path, ms[0]).unlink()  # row without file
    p1 = path_of(tmp_path, ms[1])
    p1.write_bytes(p1.read_bytes()[:5])  # wrong size
    tmp_file = p1.parent / f".tmp-leftover.safetensors.{dead_pid()}.abcd"
    tmp_file.write_bytes(b"partial")  # leftover temp file
    orphan = p1.parent / ("ab" * 32 + ".safetensors")
    orphan.write_bytes(payload_for(9))  # file without row

    tier = make_tier(tmp_path, reconcile_on_open=False)
    report = tier.check(fix=False)
    assert report.to_dict() == {
        "temp_files": 1, "missing_files": 1, "wrong_size": 1, "orphan_files": 1,
        "index_rebuilt": False, "blocks": 4, "bytes": 4 * SIZE, "fixed": False, "problems": 4,
        "torn_tails": 0,
        "index_corrupt": False, "unindexed_files": 0, "set_aside_files": 0, "refused": None,
        "recovered_blocks": 0,
    }
    assert tmp_file.exists() and orphan.exists()  # check without fix changes nothing
    tier.close()

    tier = make_tier(tmp_path)
    assert tier.startup_report is not None
    assert (tier.startup_report.problems, tier.startup_report.blocks) == (4, 2)
    assert not tmp_file.exists() and not orphan.exists() and not p1.exists()
    assert len(quarantined(tmp_path)) == 1
    assert tier.check().problems == 0
    assert [tier.get(m.block_hash) for m in ms[2:]] == [payload_for(2), payload_for(3)]
    assert tier.stats()["bytes_on_disk"] == 2 * SIZE
    tier.close()


def test_deleted_index_starts_empty_and_keeps_the_files_aside(tmp_path):
    """A lost index proves nothing orphaned: files that do not describe themselves
    (these tier-level payloads are block format 1) are set aside, not deleted."""
    tier, ms = stored(tmp_path)
    tier.close()
    for suffix in ("", "-wal", "-shm"):
        Path(str(tmp_path / "index.sqlite") + suffix).unlink(missing_ok=True)
    tier = make_tier(tmp_path)
    rep = tier.startup_report
    assert (rep.orphan_files, rep.set_aside_files, rep.recovered_blocks) == (0, 3, 0)
    assert tier.get_meta(ms[0].block_hash) is None
    assert len(list((tmp_path / "quarantine").rglob("*.safetensors"))) == 3
    assert tier.put(ms[0], payload_for(0)) is True
    tier.flush()
    assert tier.get(ms[0].block_hash) == payload_for(0)
    tier.close()


@pytest.mark.parametrize("garbage", [b"this is not a database" * 100, b""])
def test_corrupted_index_is_moved_aside_and_rebuilt(tmp_path, garbage):
    tier, ms = stored(tmp_path)
    tier.close()
    for suffix in ("-wal", "-shm"):
        Path(str(tmp_path / "index.sqlite") + suffix).unlink(missing_ok=True)
    if garbage:
        (tmp_path / "index.sqlite").write_bytes(garbage)
    else:  # keep the header, destroy every page after it
        idx = tmp_path / "index.sqlite"
        data = bytearray(idx.read_bytes())
        data[100:] = os.urandom(len(data) - 100)
        idx.write_bytes(bytes(data))
    tier = make_tier(tmp_path)
    rep = tier.startup_report
    # the files the lost index described are not proven orphans: set aside, not deleted
    assert (rep.index_rebuilt, rep.orphan_files, rep.set_aside_files, rep.blocks) == (True, 0, 3, 0)
    assert any(n.startswith("index.sqlite") for n in quarantined(tmp_path))
    kept = sorted(p.name for p in (tmp_path / "quarantine").rglob("*.safetensors"))
    assert kept == sorted(bytes(m.block_hash).hex() + ".safetensors" for m in ms)
    assert tier.get(ms[0].block_hash) is None
    assert tier.stats()["degraded"] is False
    assert tier.put(ms[0], payload_for(0)) is True
    tier.flush()
    assert tier.get(ms[0].block_hash) == payload_for(0)
    assert tier.check().problems == 0
    tier.close()


def test_index_path_taken_by_a_folder_is_moved_aside(tmp_path):
    (tmp_path / "index.sqlite").mkdir()
    (tmp_path / "index.sqlite" / "x").write_bytes(b"x")
    tier = make_tier(tmp_path)
    assert tier.startup_report.index_rebuilt is True
    assert (tmp_path / "index.sqlite").is_file()
    m = chain(NS, 1)[0]
    assert tier.get_meta(m.block_hash) is None
    assert tier.put(m, payload_for(0)) is True
    tier.flush()
    assert tier.get(m.block_hash) == payload_for(0)
    tier.close()


def test_unusable_root_degrades_to_an_in_memory_index(tmp_path):
    root = tmp_path / "file-not-folder"
    root.write_bytes(b"x")
    tier = make_tier(root)
    s = tier.stats()
    assert s["degraded"] is True and "cannot create" in s["degraded_reason"]
    m = chain(NS, 1)[0]
    assert tier.get_meta(m.block_hash) is None
    assert tier.get(m.block_hash) is None
    assert tier.put(m, payload_for(0)) is False
    assert tier.stats()["dropped_spills"]["off"] == 1
    assert tier.stats()["mode"] == "off"
    tier.close()
