"""The vision-embedding cache: byte budget (LRU, exact bytes), the SSD folder
(persisted, verified, a corrupt file is a counted miss and removed)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from promptcache.engine.models.vision_cache import VisionCache

D1, D2, D3 = (bytes([i]) * 32 for i in (1, 2, 3))


def feats(seed: int, rows: int = 4) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal((rows, 8)).astype(np.float32))


def test_ram_budget_lru_exact_bytes():
    vc = VisionCache(budget_bytes=2 * 4 * 8 * 4)  # room for two [4, 8] float32 entries
    vc.put(D1, feats(1))
    vc.put(D2, feats(2))
    assert vc.get(D1) is not None  # D1 becomes the most recent
    vc.put(D3, feats(3))  # evicts D2, the least recently used
    assert vc.get(D2) is None
    s = vc.stats()
    assert (s.entries, s.bytes, s.evictions, s.ram_hits, s.misses, s.lookups) == (2, 256, 1, 1, 1, 2)
    vc.put(b"\x09" * 32, feats(4, rows=100))  # larger than the whole budget: not kept
    assert vc.stats().dropped_too_large == 1 and vc.stats().bytes == 256


def test_ssd_folder_persists_and_verifies(tmp_path):
    vc = VisionCache(1 << 20, tmp_path)
    vc.bind_model("f" * 64)
    vc.put(D1, feats(1))
    vc.put(D2, feats(2))
    vc.flush()
    assert vc.stats().ssd_writes == 2
    folder = tmp_path / ("f" * 32)
    assert sorted(p.name for p in folder.iterdir()) == [f"{D1.hex()}.safetensors",
                                                        f"{D2.hex()}.safetensors"]
    again = VisionCache(1 << 20, tmp_path)
    again.bind_model("f" * 64)
    got = again.get(D1)
    assert got is not None and mx.array_equal(got, feats(1)).item()
    assert again.stats().ssd_hits == 1 and again.stats().entries == 1
    # flip a data byte of D2's file: the checksum catches it; a miss, the file removed
    path = folder / f"{D2.hex()}.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert again.get(D2) is None
    assert again.stats().ssd_errors == 1 and not path.exists()
    # another model's features live in another folder
    other = VisionCache(1 << 20, tmp_path)
    other.bind_model("e" * 64)
    assert other.get(D1) is None
    vc.close()


def test_a_full_writer_queue_drops_and_counts(tmp_path, monkeypatch):
    """The engine thread never waits for the disk: past the queue, writes are dropped."""
    import threading

    from promptcache.engine.models import vision_cache

    monkeypatch.setattr(vision_cache, "WRITE_QUEUE", 1)
    gate, taken = threading.Event(), threading.Event()
    vc = VisionCache(1 << 20, tmp_path)
    vc.bind_model("f" * 64)
    real = vc._write
    vc._write = lambda d, a: (taken.set(), gate.wait(), real(d, a))  # type: ignore[method-assign]
    vc.put(D1, feats(1))  # taken by the writer, which blocks on the gate
    assert taken.wait(30)
    vc.put(D2, feats(2))  # queued
    vc.put(D3, feats(3))  # queue full: dropped
    assert vc.stats().ssd_dropped == 1
    gate.set()
    vc.close()
    assert vc.stats().ssd_writes == 2 and vc.get(D3) is not None  # D3 still in RAM


def test_no_folder_without_a_model(tmp_path):
    vc = VisionCache(1 << 20, tmp_path)
    vc.put(D1, feats(1))  # not bound yet: RAM only
    assert vc.stats().ssd_writes == 0 and list(tmp_path.iterdir()) == []


def test_unusable_folder_leaves_the_cache_in_ram(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"x")  # a folder cannot be made under a file (works as root too)
    vc = VisionCache(1 << 20, blocker / "vision")
    vc.bind_model("f" * 64)  # no exception: the model still loads
    assert vc.folder is None and vc.stats().ssd_errors == 1
    vc.put(D1, feats(1))
    vc.flush()
    assert vc.get(D1) is not None and vc.stats().ssd_writes == 0
