"""The SSD budget is capped by the disk: bytes stored + free - reserve (issue 23);
a disk filled from outside (ENOSPC on a write) makes the tier evict its
least recently used blocks and stay healthy.

The disk's usage is injected (the tier's ``disk_usage`` seam), and ENOSPC at the
file seam (``ssd_files.write_temp``): no test depends on the real disk or on timing.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from ssd_helpers import NS, FakeClock, chain, make_tier, payload_for

from promptcache.config import GB, MB
from promptcache.tiers import ssd_files

SIZE = len(payload_for(0))  # payloads 0-9 have the same size


class FakeDisk:
    def __init__(self, total: int, free: int) -> None:
        self.total, self.free = total, free

    def __call__(self, path: Path) -> tuple[int, int, int]:
        return self.total, self.total - self.free, self.free


def fill(tier, clock: FakeClock, n: int, first: int = 0) -> list:  # type: ignore[no-untyped-def]
    ms = chain(NS, first + n)[first:]
    for i, m in enumerate(ms, start=first):
        clock.advance(1)  # a strict LRU order
        assert tier.put(m, payload_for(i)) is True
        tier.flush()
    return ms


def on_disk(tier) -> list[bytes]:  # type: ignore[no-untyped-def]
    return sorted(bytes(r.meta.block_hash) for r in tier.rows())


@pytest.mark.parametrize("total, reserve", [(64 * MB, 64 * MB // 20), (100 * GB, GB)])
def test_default_reserve_is_five_percent_of_the_disk_at_most_1gb(tmp_path, total, reserve):
    disk = FakeDisk(total, free=total // 2)
    tier = make_tier(tmp_path, disk_usage=disk)  # budget_bytes: the 10 GB default
    s = tier.stats()
    assert (s["disk_reserve_bytes"], s["disk_free_bytes"]) == (reserve, total // 2)
    assert s["budget_bytes"] == min(10 * GB, total // 2 - reserve)
    assert s["config_budget_bytes"] == 10 * GB
    tier.close()


def test_budget_is_capped_by_free_space_minus_reserve(tmp_path):
    clock = FakeClock()
    disk = FakeDisk(total=1000 * SIZE, free=4 * SIZE)
    tier = make_tier(tmp_path, clock=clock, disk_usage=disk, disk_reserve_bytes=SIZE,
                     sweep_interval_s=3600)
    assert tier.stats()["budget_bytes"] == 3 * SIZE
    ms = fill(tier, clock, 5)
    s = tier.stats()
    assert (s["blocks_on_disk"], s["bytes_on_disk"]) == (3, 3 * SIZE)
    assert (s["evictions_disk"], s["evictions_capacity"], s["degraded"]) == (2, 0, False)
    assert on_disk(tier) == sorted(bytes(m.block_hash) for m in ms[2:])  # LRU went first
    tier.close()


def test_disk_filled_from_outside_is_made_room_for_at_the_sweep(tmp_path):
    clock = FakeClock()
    disk = FakeDisk(total=1000 * SIZE, free=100 * SIZE)
    tier = make_tier(tmp_path, clock=clock, disk_usage=disk, disk_reserve_bytes=2 * SIZE,
                     sweep_interval_s=3600)
    ms = fill(tier, clock, 4)
    assert tier.stats()["evictions_disk"] == 0
    disk.free = SIZE  # another program filled the disk: only 1 block's worth left
    tier.sweep()
    s = tier.stats()
    # cap = 4 stored + 1 free - 2 reserve = 3 blocks
    assert (s["budget_bytes"], s["blocks_on_disk"], s["evictions_disk"]) == (3 * SIZE, 3, 1)
    assert on_disk(tier) == sorted(bytes(m.block_hash) for m in ms[1:])
    assert s["degraded"] is False
    tier.close()


def test_bigger_disk_budget_stays_the_configured_one(tmp_path):
    clock = FakeClock()
    disk = FakeDisk(total=1000 * SIZE, free=500 * SIZE)
    tier = make_tier(tmp_path, clock=clock, disk_usage=disk, disk_reserve_bytes=0,
                     budget_bytes=2 * SIZE, sweep_interval_s=3600)
    fill(tier, clock, 3)
    s = tier.stats()
    assert (s["budget_bytes"], s["blocks_on_disk"]) == (2 * SIZE, 2)
    assert (s["evictions_capacity"], s["evictions_disk"]) == (1, 0)
    tier.close()


def full_once(monkeypatch: pytest.MonkeyPatch, disk: FakeDisk) -> list[int]:
    """The next ``write_temp`` finds the disk full (and the disk says so from then on)."""
    real = ssd_files.write_temp
    calls = [0]

    def write_temp(*args, **kw):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 1:
            disk.free = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kw)

    monkeypatch.setattr(ssd_files, "write_temp", write_temp)
    return calls


def test_enospc_on_write_evicts_lru_and_the_tier_stays_healthy(tmp_path, monkeypatch):
    clock = FakeClock()
    disk = FakeDisk(total=1000 * SIZE, free=100 * SIZE)
    tier = make_tier(tmp_path, clock=clock, disk_usage=disk, disk_reserve_bytes=0,
                     sweep_interval_s=3600)
    a, b, c = fill(tier, clock, 3)
    calls = full_once(monkeypatch, disk)
    (d,) = fill(tier, clock, 1, first=3)
    assert calls[0] == 2  # failed, room made, written
    s = tier.stats()
    assert (s["disk_full"], s["evictions_disk"], s["write_errors"], s["spills"]) == (1, 1, 0, 4)
    assert (s["degraded"], s["degraded_reason"], s["blocks_on_disk"]) == (False, None, 3)
    assert s["budget_bytes"] == 3 * SIZE  # what the disk holds now
    assert on_disk(tier) == sorted(bytes(m.block_hash) for m in (b, c, d))
    assert tier.get(a.block_hash) is None
    assert tier.get(d.block_hash) == payload_for(3)
    assert [p.name for p in tmp_path.rglob(".tmp-*")] == []
    assert tier.check().problems == 0
    tier.close()


def test_enospc_with_nothing_to_evict_degrades(tmp_path, monkeypatch):
    clock = FakeClock()
    disk = FakeDisk(total=1000 * SIZE, free=100 * SIZE)
    tier = make_tier(tmp_path, clock=clock, disk_usage=disk, disk_reserve_bytes=0,
                     sweep_interval_s=3600)
    full_once(monkeypatch, disk)
    m = chain(NS, 1)[0]
    assert tier.put(m, payload_for(0)) is True
    tier.flush()
    s = tier.stats()
    assert (s["disk_full"], s["evictions_disk"], s["write_errors"]) == (1, 0, 1)
    assert s["degraded"] is True and "No space left" in s["degraded_reason"]
    assert s["blocks_on_disk"] == 0
    tier.close()


def test_full_disk_at_startup_keeps_the_tier_on_and_evicts(tmp_path, monkeypatch):
    clock = FakeClock()
    disk = FakeDisk(total=1000 * SIZE, free=100 * SIZE)
    tier = make_tier(tmp_path, clock=clock, disk_usage=disk, disk_reserve_bytes=SIZE)
    fill(tier, clock, 3)
    tier.close()

    def full(root: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(root))

    monkeypatch.setattr(ssd_files, "probe_writable", full)
    disk.free = 0  # filled from outside while the server was down
    tier = make_tier(tmp_path, clock=clock, disk_usage=disk, disk_reserve_bytes=SIZE)
    s = tier.stats()
    # on, and at startup already down to stored 3 + free 0 - reserve 1 = 2 blocks
    assert (s["mode"], s["degraded"], s["blocks_on_disk"], s["evictions_disk"]) == (
        "read_write", False, 2, 1)
    tier.close()
