"""A cache folder written by an older version (block format 1/2: one safetensors tensor
per array, sha256 in the index) is never misread and never crashes: each old block is a
miss counted in ``old_format_blocks`` (not a tier error, not quarantined), recomputed,
and its rewrite (block format 3) replaces the old copy; a pack export names it."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save as st_save
from ssd_helpers import make_tier

from promptcache.cache import PromptCache
from promptcache.codec import decode
from promptcache.config import CacheConfig
from promptcache.meta import Namespace
from promptcache.packfile import PackError
from promptcache.packs import collect

BS = 4
NS = Namespace("old-format-model", block_size=BS, tenant="alice")
A = list(range(100, 112))  # 3 full blocks


def arrays(start: int, end: int, snapshot: bool) -> dict[str, np.ndarray]:
    k = np.arange(start, end, dtype=np.float32).reshape(1, 1, -1, 1).repeat(2, axis=3)
    return {"0.k": k, "0.v": -k}


def cache_on(path: Path) -> PromptCache:
    return PromptCache(CacheConfig(block_size=BS, ram_budget_bytes=1 << 20),
                       lower=[make_tier(path)], write_through=True)


def make_old_folder(path: Path) -> list[bytes]:
    """Blocks of ``A`` as an older version stored them: format 2 files (one tensor per
    array, ``pc.v`` = 2) whose index rows hold a sha256."""
    cache = cache_on(path)
    assert cache.store(NS, A, len(A), arrays) == 3
    cache.flush()
    tier = cache.lower[0]
    rows = list(tier.rows())  # type: ignore[attr-defined]
    cache.close(persist=False)
    db = sqlite3.connect(path / "index.sqlite")
    for r in rows:
        start = r.meta.start
        old = st_save(arrays(start, start + BS, False),
                      metadata={"block_hash": r.meta.block_hash.hex(), "pc.v": "2"})
        (path / r.file_name).write_bytes(old)
        db.execute("UPDATE blocks SET checksum=?, file_bytes=? WHERE hash=?",
                   (hashlib.sha256(old).hexdigest(), len(old), bytes(r.meta.block_hash)))
    db.commit()
    db.close()
    return [r.file_name for r in rows]


def test_an_old_cache_folder_is_a_counted_miss_then_rewritten(tmp_path: Path) -> None:
    names = make_old_folder(tmp_path)
    cache = cache_on(tmp_path)
    assert cache.lookup(A + [7], NS).tokens_by_tier == {"ssd": 12}  # the index knows them
    hit = cache.acquire(A + [7], NS)
    assert hit.num_tokens == 0  # the first block is old: nothing restored, nothing misread
    cache.release(hit)
    s = cache.stats()
    assert (s.old_format_blocks, s.tier_errors, s.promotions) == (1, 0, 0)
    ssd = cache.lower[0].stats()
    assert (ssd["corrupt"], ssd["blocks_on_disk"]) == (0, 3)  # not taken for damage
    # the recomputed blocks are stored again: format 3 replaces the old copies
    assert cache.store(NS, A, len(A), arrays) == 3
    cache.flush()
    rows = list(cache.lower[0].rows())  # type: ignore[attr-defined]
    assert len(rows) == 3 and all(len(r.checksum) == 32 for r in rows)
    for r in rows:
        assert decode((tmp_path / r.file_name).read_bytes(), verify=True).desc.meta == r.meta
    assert not any((tmp_path / n).exists() for n in names if n not in {r.file_name for r in rows})
    cache.close(persist=False)
    fresh = cache_on(tmp_path)
    hit = fresh.acquire(A + [7], NS)
    assert hit.num_tokens == 12 and fresh.stats().old_format_blocks == 0
    for i, (_meta, payload) in enumerate(hit.blocks):
        assert np.array_equal(payload["0.k"], arrays(i * BS, (i + 1) * BS, False)["0.k"])
    fresh.release(hit)
    fresh.close(persist=False)


def test_exporting_an_old_block_is_refused_by_name(tmp_path: Path) -> None:
    make_old_folder(tmp_path)
    cache = cache_on(tmp_path)
    with pytest.raises(PackError, match="older block format"):
        collect(cache, NS, tokens=A + [7])
    cache.close(persist=False)
