"""The vision-embedding cache: byte budget (LRU, exact bytes), the SSD folder
(persisted, verified, a corrupt file is a counted miss and removed)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from promptcache.engine.vision_cache import VisionCache

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


def test_no_folder_without_a_model(tmp_path):
    vc = VisionCache(1 << 20, tmp_path)
    vc.put(D1, feats(1))  # not bound yet: RAM only
    assert vc.stats().ssd_writes == 0 and list(tmp_path.iterdir()) == []
