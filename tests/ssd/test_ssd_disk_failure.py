"""A failing disk degrades the tier; serving continues and nothing raises into puts."""

import builtins
import errno
import os

import pytest
from ssd_helpers import NS, FakeClock, chain, make_tier, payload_for

from promptcache.errors import CorruptBlockError, TierError
from promptcache.tiers import ssd_files


def test_enospc_on_publish_degrades_and_recovers(tmp_path, monkeypatch):
    clock = FakeClock()
    tier = make_tier(tmp_path, clock=clock, degraded_backoff_s=30)
    a, b, c = chain(NS, 3)
    tier.put(a, payload_for(0))
    tier.flush()

    real_replace, real_link = os.replace, os.link

    def full_disk(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    monkeypatch.setattr(os, "link", full_disk)
    assert tier.put(b, payload_for(1)) is True  # accepted: the failure happens in the writer
    tier.flush()
    s = tier.stats()
    assert s["degraded"] is True and "No space left" in s["degraded_reason"]
    assert (s["write_errors"], s["spills"], s["dropped_spills"]["degraded"]) == (1, 1, 1)
    assert tier.get(a.block_hash) == payload_for(0)  # reads keep working
    assert tier.get_meta(b.block_hash) is None
    assert tier.put(c, payload_for(2)) is False  # dropped during the backoff
    assert tier.stats()["dropped_spills"]["degraded"] == 2
    assert [p.name for p in tmp_path.rglob(".tmp-*")] == []  # the temp file was removed

    monkeypatch.setattr(os, "replace", real_replace)
    monkeypatch.setattr(os, "link", real_link)
    clock.advance(31)
    assert tier.put(c, payload_for(2)) is True
    tier.flush()
    s = tier.stats()
    assert (s["degraded"], s["degraded_reason"], s["spills"]) == (False, None, 2)
    assert tier.get(c.block_hash) == payload_for(2)
    assert tier.check().problems == 0
    tier.close()


def test_read_only_folder_simulated_with_erofs(tmp_path, monkeypatch):
    tier = make_tier(tmp_path)
    a, b = chain(NS, 2)
    tier.put(a, payload_for(0))
    tier.flush()
    real_open = builtins.open

    def ro_open(file, mode="r", *args, **kw):
        if any(ch in mode for ch in "wax+"):
            raise OSError(errno.EROFS, "Read-only file system", str(file))
        return real_open(file, mode, *args, **kw)

    monkeypatch.setattr(ssd_files, "open", ro_open, raising=False)
    assert tier.put(b, payload_for(1)) is True
    tier.flush()
    s = tier.stats()
    assert s["degraded"] is True and "Read-only" in s["degraded_reason"]
    assert tier.get(a.block_hash) == payload_for(0)
    tier.close()


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores folder permissions")
def test_read_only_folder_with_permissions(tmp_path):
    tier = make_tier(tmp_path)
    a, b = chain(NS, 2)
    tier.put(a, payload_for(0))
    tier.flush()
    blocks = tmp_path / NS.key / NS.tenant / "blocks"
    for d in [blocks, *blocks.iterdir()]:
        d.chmod(0o555)
    try:
        tier.put(b, payload_for(1))
        tier.flush()
        assert tier.stats()["degraded"] is True
        assert tier.get(a.block_hash) == payload_for(0)
    finally:
        for d in [blocks, *blocks.iterdir()]:
            d.chmod(0o755)
        tier.close()


def test_tenant_folder_replaced_by_a_file_degrades(tmp_path):
    tier = make_tier(tmp_path)
    (tmp_path / NS.key).mkdir()
    (tmp_path / NS.key / NS.tenant).write_bytes(b"not a folder")
    assert tier.put(chain(NS, 1)[0], payload_for(0)) is True
    tier.flush()
    s = tier.stats()
    assert (s["degraded"], s["write_errors"], s["spills"]) == (True, 1, 0)
    tier.close()


def test_read_error_is_a_tier_error_and_keeps_the_row(tmp_path, monkeypatch):
    tier = make_tier(tmp_path)
    a = chain(NS, 1)[0]
    tier.put(a, payload_for(0))
    tier.flush()
    import promptcache.tiers.ssd_read as ssd_mod

    def eio_open(file, mode="r", *args, **kw):
        raise OSError(errno.EIO, "Input/output error", str(file))

    monkeypatch.setattr(ssd_mod, "open", eio_open, raising=False)
    with pytest.raises(TierError) as ei:
        tier.get(a.block_hash)
    assert not isinstance(ei.value, CorruptBlockError)
    s = tier.stats()
    assert (s["read_errors"], s["degraded"], s["corrupt"]) == (1, True, 0)
    monkeypatch.undo()
    assert tier.get_meta(a.block_hash) == a
    assert tier.get(a.block_hash) == payload_for(0)
    tier.close()


def test_writer_survives_an_unexpected_exception(tmp_path, monkeypatch):
    tier = make_tier(tmp_path)
    a, b = chain(NS, 2)

    def boom(*args, **kw):
        raise RuntimeError("bug")

    monkeypatch.setattr(ssd_files, "write_temp", boom)
    tier.put(a, payload_for(0))
    tier.flush()
    monkeypatch.undo()
    s = tier.stats()
    assert (s["queue_depth"], s["write_errors"], s["spills"]) == (0, 1, 0)
    assert tier.get_meta(a.block_hash) is None
    assert tier.put(b, payload_for(1)) is True
    tier.flush()
    assert tier.get(b.block_hash) == payload_for(1)
    tier.close()
