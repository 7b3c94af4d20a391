"""The Tier protocol of this round on the SSD tier: PayloadSource payloads encoded
on the writer thread, back-pressure puts (timeout), has_room, flush(timeout), and
tenant-scoped delete_session."""

from __future__ import annotations

import threading
import time

import pytest
from ssd_helpers import NS, NS_BOB, chain, make_tier, payload_for

from promptcache.tiers.base import BytesPayload, LazyPayload, PayloadSource, as_source


class RecordingSource:
    """A PayloadSource that records the threads that encode it."""

    def __init__(self, data: bytes) -> None:
        self._src = LazyPayload(self._make, len(data))
        self.data = data
        self.threads: list[str] = []

    def _make(self) -> bytes:
        self.threads.append(threading.current_thread().name)
        return self.data

    @property
    def nbytes(self) -> int:
        return self._src.nbytes

    def encode(self) -> bytes:
        return self._src.encode()


def wait_until(cond, what: str, limit: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    """Wait for a condition another thread makes true (a deadline, not a timing assertion)."""
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


def test_lazy_payload_encodes_once_across_threads():
    calls = []
    barrier = threading.Barrier(4)

    def make() -> bytes:
        calls.append(1)
        return b"abc"

    src = LazyPayload(make, 100)
    assert src.nbytes == 100 and not src.encoded
    out: list[bytes] = []

    def user() -> None:
        barrier.wait()
        out.append(src.encode())

    threads = [threading.Thread(target=user) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [1] and out == [b"abc"] * 4 and src.nbytes == 3
    assert isinstance(src, PayloadSource) and isinstance(BytesPayload(b"x"), PayloadSource)
    with pytest.raises(ValueError):
        as_source("text")  # type: ignore[arg-type]


def test_lazy_payload_remembers_a_failure():
    def make() -> bytes:
        raise RuntimeError("cannot encode")

    src = LazyPayload(make, 10)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="cannot encode"):
            src.encode()


def test_payload_source_is_encoded_on_the_writer_thread(tmp_path):
    tier = make_tier(tmp_path)
    m = chain(NS, 1)[0]
    src = RecordingSource(payload_for(0))
    assert tier.put(m, src, ["s"]) is True
    tier.flush()
    assert src.threads == ["promptcache-ssd-writer"]
    assert tier.get(m.block_hash) == payload_for(0)
    assert tier.stats()["spills"] == 1
    tier.close()


def test_a_source_shared_by_two_tiers_is_encoded_once(tmp_path):
    a, b = make_tier(tmp_path / "a"), make_tier(tmp_path / "b")
    m = chain(NS, 1)[0]
    src = RecordingSource(payload_for(0))
    assert a.put(m, src) and b.put(m, src)
    a.flush()
    b.flush()
    assert len(src.threads) == 1
    assert a.get(m.block_hash) == b.get(m.block_hash) == payload_for(0)
    a.close()
    b.close()


def test_a_source_that_cannot_encode_is_a_counted_failed_write(tmp_path):
    tier = make_tier(tmp_path)
    a, b = chain(NS, 2)

    def broken() -> bytes:
        raise ValueError("bad payload")

    assert tier.put(a, LazyPayload(broken, 64)) is True
    assert tier.put(b, payload_for(1)) is True
    tier.flush()
    s = tier.stats()
    assert (s["encode_errors"], s["spills"], s["queue_depth"]) == (1, 1, 0)
    assert tier.get_meta(a.block_hash) is None and tier.get(b.block_hash) == payload_for(1)
    tier.close()


def test_a_queued_source_is_served_before_it_is_written(tmp_path):
    tier = make_tier(tmp_path)
    m = chain(NS, 1)[0]
    src = RecordingSource(payload_for(0))
    with tier.catalog.write_lock:  # the writer cannot write while we hold it
        tier.put(m, src)
        assert tier.get(m.block_hash) == payload_for(0)
        assert src.threads == [threading.current_thread().name]
    tier.flush()
    assert len(src.threads) == 1  # memoised: the writer reused the bytes
    tier.close()


def test_back_pressure_put_waits_for_room_and_flush_has_a_timeout(tmp_path):
    tier = make_tier(tmp_path, queue_size=2)
    ms = chain(NS, 5)
    result: list[bool] = []
    with tier.catalog.write_lock:
        assert tier.put(ms[0], payload_for(0)) is True
        wait_until(lambda: tier.queued.queue.qsize() == 0, "the writer to take the first block")
        assert tier.put(ms[1], payload_for(1)) and tier.put(ms[2], payload_for(2))
        assert tier.has_room() is False and tier.has_room(timeout=0.01) is False
        assert tier.put(ms[3], payload_for(3)) is False  # timeout 0: refused at once
        assert tier.flush(timeout=0) is False
        waiter = threading.Thread(target=lambda: result.append(
            tier.put(ms[4], payload_for(4), timeout=None)))
        waiter.start()
        # the waiting block is visible as soon as the put is waiting
        wait_until(lambda: tier.get_meta(ms[4].block_hash) is not None, "the put to wait")
        assert result == []
    waiter.join()
    assert result == [True]
    assert tier.flush(timeout=None) is True and tier.has_room() is True
    s = tier.stats()
    assert (s["dropped_spills"]["queue_full"], s["spills"]) == (1, 4)
    assert [tier.get_meta(m.block_hash) is not None for m in ms] == [True, True, True, False, True]
    tier.close()


def test_a_put_waiting_for_room_gives_up_after_its_timeout(tmp_path):
    tier = make_tier(tmp_path, queue_size=1)
    ms = chain(NS, 3)
    with tier.catalog.write_lock:
        tier.put(ms[0], payload_for(0))
        wait_until(lambda: tier.queued.queue.qsize() == 0, "the writer to take the first block")
        assert tier.put(ms[1], payload_for(1)) is True
        assert tier.put(ms[2], payload_for(2), timeout=0.01) is False
        assert tier.get_meta(ms[2].block_hash) is None
    tier.flush()
    assert tier.stats()["dropped_spills"]["queue_full"] == 1
    assert tier.stats()["queue_depth"] == 0
    tier.close()


def test_delete_session_within_one_tenant(tmp_path):
    tier = make_tier(tmp_path)
    alice, bob = chain(NS, 2), chain(NS_BOB, 2)
    for i, m in enumerate(alice + bob):
        tier.put(m, payload_for(i), ["conv"])  # the same session id in two tenants
    tier.flush()
    assert tier.delete_session("conv", tenant="alice") == 2
    assert all(tier.get_meta(m.block_hash) is None for m in alice)
    assert all(tier.sessions_of(m.block_hash) == ["conv"] for m in bob)
    assert tier.delete_session("conv", tenant="alice") == 0
    assert tier.delete_session("conv") == 2  # None: every tenant (a global admin)
    assert tier.stats()["blocks_on_disk"] == 0
    with pytest.raises(ValueError):
        tier.delete_session("conv", tenant="")
    tier.close()


def test_delete_session_within_one_tenant_reaches_queued_blocks(tmp_path):
    tier = make_tier(tmp_path)
    a, b = chain(NS, 1)[0], chain(NS_BOB, 1)[0]
    with tier.catalog.write_lock:
        tier.put(a, payload_for(0), ["conv"])
        tier.put(b, payload_for(1), ["conv"])
        assert tier.delete_session("conv", tenant="bob") == 1
    tier.flush()
    assert tier.get_meta(a.block_hash) == a and tier.sessions_of(a.block_hash) == ["conv"]
    assert tier.get_meta(b.block_hash) is None
    tier.close()
