"""Self-describing block files (block format 3, ``blockdesc``): a lost or corrupt
index is rebuilt from the files (``cache check --fix``, or the startup of a tier
whose index is gone), every block comes back with its sessions; files that cannot
prove what they are (an older format, damaged) are set aside, never deleted."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import xxhash
from ssd_helpers import NS as TIER_NS
from ssd_helpers import chain, legacy_payload_for, make_tier

from promptcache.blockdesc import (
    FORMAT_VERSION,
    Description,
    describe,
    read_description,
    verify,
)
from promptcache.cache import PromptCache
from promptcache.cache.types import NumpyAdapter
from promptcache.cli import main
from promptcache.config import CacheConfig
from promptcache.meta import Namespace
from promptcache.tiers.ssd_files import block_rel_path

BS = 4
NS = Namespace("rebuild-model", block_size=BS, tenant="alice")
A = list(range(100, 112))  # 3 full blocks
B = list(range(200, 210))  # 2 full blocks + a partial one of 2 tokens


def arrays(start: int, end: int, snapshot: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(start * 1000 + end)
    k = rng.standard_normal((1, 2, end - start, 8), dtype=np.float32)
    return {"0.k": k, "0.v": -k}


def open_cache(path: Path) -> tuple[PromptCache, object]:
    ssd = make_tier(path)
    cache = PromptCache(CacheConfig(block_size=BS, ram_budget_bytes=1 << 20), lower=[ssd],
                        write_through=True)
    return cache, ssd


def populate(path: Path) -> dict[bytes, tuple[str, ...]]:
    """Blocks of two sessions, written through to the SSD. Returns hash -> sessions."""
    cache, ssd = open_cache(path)
    assert cache.store(NS, A, len(A), arrays, session_id="conv-a") == 3
    assert cache.store(NS, B, len(B), arrays, session_id="conv-b") == 3
    cache.flush()
    rows = {bytes(r.meta.block_hash): tuple(ssd.sessions_of(r.meta.block_hash))  # type: ignore[attr-defined]
            for r in ssd.rows()}  # type: ignore[attr-defined]
    assert len(rows) == 6
    cache.close(persist=False)
    return rows


def block_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.safetensors") if "quarantine" not in p.parts)


def corrupt_index(root: Path) -> None:
    for suffix in ("-wal", "-shm"):
        Path(str(root / "index.sqlite") + suffix).unlink(missing_ok=True)
    (root / "index.sqlite").write_bytes(b"this is not a database" * 100)


def assert_all_back(root: Path, before: dict[bytes, tuple[str, ...]]) -> None:
    cache, ssd = open_cache(root)
    rows = {bytes(r.meta.block_hash): tuple(ssd.sessions_of(r.meta.block_hash))  # type: ignore[attr-defined]
            for r in ssd.rows()}  # type: ignore[attr-defined]
    assert rows == before
    assert cache.lookup(A + [7], NS).tokens_by_tier == {"ssd": 12}
    assert cache.lookup(B + [7], NS).tokens_by_tier == {"ssd": 10}
    hit = cache.acquire(A + [7], NS)
    assert len(hit.blocks) == 3
    for i, (_meta, payload) in enumerate(hit.blocks):
        want = arrays(i * BS, (i + 1) * BS, False)
        assert np.array_equal(payload["0.k"], want["0.k"])
    cache.release(hit)
    assert ssd.delete_session("conv-a") == 3  # type: ignore[attr-defined]
    cache.close(persist=False)


def test_cache_check_fix_rebuilds_a_corrupt_index_from_the_files(tmp_path, capsys):
    before = populate(tmp_path)
    files = block_files(tmp_path)
    corrupt_index(tmp_path)

    assert main(["cache", "check", "--cache-dir", str(tmp_path)]) == 1  # changes nothing
    out = json.loads(capsys.readouterr().out)
    assert (out["index_corrupt"], out["unindexed_files"], out["recovered_blocks"]) == (True, 6, 0)
    assert block_files(tmp_path) == files

    assert main(["cache", "check", "--fix", "--cache-dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["index_rebuilt"], out["recovered_blocks"], out["set_aside_files"],
            out["orphan_files"], out["blocks"]) == (True, 6, 0, 0, 6)
    assert block_files(tmp_path) == files
    assert main(["cache", "check", "--cache-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    assert_all_back(tmp_path, before)


def test_a_lost_index_is_rebuilt_at_startup(tmp_path):
    before = populate(tmp_path)
    for suffix in ("", "-wal", "-shm"):
        Path(str(tmp_path / "index.sqlite") + suffix).unlink(missing_ok=True)
    tier = make_tier(tmp_path)
    rep = tier.startup_report
    assert rep is not None
    assert (rep.recovered_blocks, rep.set_aside_files, rep.orphan_files, rep.blocks) == (6, 0, 0, 6)
    tier.close()
    assert_all_back(tmp_path, before)


def test_old_and_damaged_files_are_set_aside_the_rest_recovered(tmp_path):
    populate(tmp_path)
    old = make_tier(tmp_path)  # a block format 1 file (what an older cache wrote)
    m = chain(TIER_NS, 1)[0]
    old.put(m, legacy_payload_for(0))
    old.close()
    damaged = [p for p in block_files(tmp_path) if NS.key in p.parts][0]
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF  # a flipped data byte: the digest no longer matches
    damaged.write_bytes(bytes(data))
    corrupt_index(tmp_path)

    assert main(["cache", "check", "--fix", "--cache-dir", str(tmp_path)]) == 0
    tier = make_tier(tmp_path)
    s = tier.stats()
    assert s["blocks_on_disk"] == 5
    aside = sorted(p.name for p in (tmp_path / "quarantine").rglob("*.safetensors"))
    old_name = Path(block_rel_path(m.namespace_key, m.tenant, m.block_hash.hex())).name
    assert aside == sorted([damaged.name, old_name])
    assert tier.get_meta(m.block_hash) is None
    tier.close()


# -- the description itself ------------------------------------------------------------

def described():  # type: ignore[no-untyped-def]
    ns = Namespace("desc-model", block_size=BS, tenant="bob")
    from promptcache.hashing import hash_block

    h = hash_block(ns.root, (1, 2, 3, 4), (b"img",))
    from promptcache.meta import BlockMeta

    meta = BlockMeta(h, ns.root, (1, 2, 3, 4), 0, extra_keys=(b"img",), nbytes=512,
                     truncatable=False, snapshot=True, namespace_key=ns.key, tenant="bob")
    buf, layout = NumpyAdapter().to_buffer(arrays(0, 4, False))
    digest = xxhash.xxh3_128_hexdigest(buf.tobytes())
    return meta, buf, describe(Description(meta, ("s2", "s1"), layout, digest))


def test_description_round_trip_and_verify():
    meta, buf, md = described()
    assert md["pc.v"] == FORMAT_VERSION
    assert md["block_hash"] == meta.block_hash.hex()
    desc = read_description(md)
    assert desc is not None
    assert (desc.meta, desc.sessions, desc.checksum) == (
        meta, ("s1", "s2"), xxhash.xxh3_128_hexdigest(buf.tobytes()))
    assert verify(desc, buf) is True
    other = buf.copy()
    other[-1] ^= 1
    assert verify(desc, other) is False


def test_description_errors():
    meta, buf, md = described()
    assert read_description({"block_hash": "00", "layout": "x"}) is None  # format 1
    assert read_description({**md, "pc.v": "2"}) is None  # format 2 (sha256 over arrays)
    assert read_description({**md, "pc.v": "9"}) is None  # a later format: ignored
    with pytest.raises(ValueError):
        read_description({k: v for k, v in md.items() if k != "pc.tokens"})
    with pytest.raises(ValueError):
        read_description({**md, "pc.tokens": "abc"})
    with pytest.raises(ValueError):
        read_description({**md, "pc.sessions": "{}"})
    desc = read_description({**md, "pc.tokens": np.asarray([1, 2, 3, 5], "<u4").tobytes().hex()})
    assert desc is not None and verify(desc, buf) is False  # the hash chain does not hold
