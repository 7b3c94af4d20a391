"""End to end through the SSD tier: a restarted engine hits blocks written by the first."""

from __future__ import annotations

import numpy as np
import pytest

from promptcache.cli.wiring import build_cache
from promptcache.config import CacheConfig, SSDConfig
from promptcache.engine.engine import Engine
from promptcache.serving_config import EngineConfig


def test_restarted_engine_hits_ssd_blocks(tiny_llama_path, tmp_path):
    ssd = SSDConfig(path=tmp_path / "blocks", policy="write_through", fsync=False)
    ec, cc = EngineConfig(restore_plan="load", prefill_chunk_tokens=16), CacheConfig(block_size=8, ram_budget_bytes=64 * 1024**2)
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 1000, size=30)]
    with Engine.load(tiny_llama_path, ec, cc, cache=build_cache(cc, ssd)) as first:
        r1 = first.generate(prompt, max_tokens=4)
        assert r1.usage.saved_mid_prefill == 2 and r1.usage.saved_end_prefill == 2
    with Engine.load(tiny_llama_path, ec, cc, cache=build_cache(cc, ssd)) as second:
        r2 = second.generate(prompt, max_tokens=4)
        ref = second.generate(prompt, max_tokens=4, use_cache=False)
        stats = second.stats()
    assert r2.usage.cached_tokens == 29
    assert r2.usage.cached_by_tier == {"ssd": 29}
    assert r2.tokens == r1.tokens == ref.tokens
    assert stats["cache"]["promotions"] == 4


@pytest.mark.parametrize("segment_bytes", [0, 1 << 20])
def test_a_run_read_from_the_ssd_is_one_array_and_one_copy_per_layer(tiny_llama_path, tmp_path,
                                                                     segment_bytes):
    from promptcache.engine.payload.blockbuf import BlockPayload

    ssd = SSDConfig(path=tmp_path / "blocks", policy="write_through", fsync=False,
                    segment_bytes=segment_bytes)
    ec, cc = EngineConfig(restore_plan="load", prefill_chunk_tokens=16), CacheConfig(block_size=8, ram_budget_bytes=64 * 1024**2)
    prompt = [int(t) for t in np.random.default_rng(6).integers(3, 1000, size=41)]
    with Engine.load(tiny_llama_path, ec, cc, cache=build_cache(cc, ssd)) as first:
        r1 = first.generate(prompt, max_tokens=4)
    with Engine.load(tiny_llama_path, ec, cc, cache=build_cache(cc, ssd)) as second:
        r2 = second.generate(prompt, max_tokens=4)
        ref = second.generate(prompt, max_tokens=4, use_cache=False)
        blocks = sorted((b for b in second.cache.pool.blocks() if b.start < 40),
                        key=lambda b: b.start)
        stats = second.engine_stats()
    assert r2.usage.cached_by_tier == {"ssd": 40} and r2.tokens == r1.tokens == ref.tokens
    # the five blocks were read as one run: rows 0-4 of one array made from host memory
    payloads = [b.payload for b in blocks]
    assert all(isinstance(p, BlockPayload) for p in payloads)
    assert [p.row for p in payloads] == [0, 1, 2, 3, 4]
    assert len({id(p.slab) for p in payloads}) == 1 and payloads[0].slab is not None
    # one file per block: the rows stacked on the host first; a segment: the run's span of
    # the mapping copied once, its headers between the rows
    step = payloads[0].layout.nbytes
    assert payloads[0].slab.ndim == (1 if segment_bytes else 2)
    assert all(p.step > step if segment_bytes else p.step == step for p in payloads)
    # restored with one strided copy per layer array for the run, one for the room
    assert stats["restore_copies"] == 2 * 2 * 2


def test_bfloat16_blocks_come_back_from_ssd_as_bfloat16(tmp_path):
    """Apple GPUs keep KV in bfloat16; numpy has no bf16, so it travels as uint16 + meta."""
    import mlx.core as mx

    from promptcache.cache import PromptCache
    from promptcache.engine.payload.payload import MLXPayloadAdapter
    from promptcache.meta import Namespace
    from promptcache.tiers.ssd import SSDTier

    ns = Namespace("bf16-model", 4, kv_spec="bfloat16")
    k = mx.arange(2 * 4 * 3, dtype=mx.float32).reshape(1, 2, 4, 3).astype(mx.bfloat16) / 7

    def payload_for(start, end, snapshot):
        out = {"0.k": k + start, "0.v": -(k + start)}
        mx.eval(list(out.values()))  # evaluated, as the engine's payloads are: a tier's
        return out  # writer thread encodes them (docs/INTERFACES.md, block payloads)

    tier = SSDTier(SSDConfig(path=tmp_path, fsync=False))
    cache = PromptCache(CacheConfig(block_size=4, ram_budget_bytes=1 << 20),
                        adapter=MLXPayloadAdapter(), lower=[tier], write_through=True)
    cache.store(ns, [1, 2, 3, 4, 5, 6, 7, 8], 8, payload_for)
    cache.close()
    tier = SSDTier(SSDConfig(path=tmp_path, fsync=False))
    cache = PromptCache(CacheConfig(block_size=4, ram_budget_bytes=1 << 20),
                        adapter=MLXPayloadAdapter(), lower=[tier])
    hit = cache.acquire([1, 2, 3, 4, 5, 6, 7, 8, 9], ns)
    assert hit.num_tokens == 8 and hit.tokens_by_tier == {"ssd": 8}
    for (meta, payload) in hit.blocks:
        want = payload_for(meta.start, meta.end, False)
        for name in ("0.k", "0.v"):
            assert payload[name].dtype == mx.bfloat16
            assert mx.array_equal(payload[name], want[name]).item()
    cache.release(hit)
    cache.close()


def test_engine_close_persists_every_ram_block_under_write_back(tiny_llama_path, tmp_path):
    """Engine.close() stops the engine thread, then the cache persists every RAM block
    the SSD lacks (durability: a clean close keeps the whole cache), through a writer
    queue of 2 (back-pressure, nothing dropped); a restarted engine hits all of it."""
    ssd = SSDConfig(path=tmp_path / "blocks", policy="write_back", fsync=False, queue_size=2)
    ec = EngineConfig(restore_plan="load", prefill_chunk_tokens=16)
    cc = CacheConfig(block_size=4, ram_budget_bytes=64 * 1024**2)
    prompt = [int(t) for t in np.random.default_rng(11).integers(3, 1000, size=400)]
    first = Engine.load(tiny_llama_path, ec, cc, cache=build_cache(cc, ssd))
    cache = first.cache
    assert cache is not None
    r1 = first.generate(prompt, max_tokens=4)
    st = cache.stats().to_dict()
    # prompt + output[:-1] = 403 tokens: 100 full blocks + a partial one; write_back: none
    # written before the close
    assert (st["ram_blocks"], st["tiers"]["ssd"]["blocks_on_disk"]) == (101, 0)
    first.close()
    report = cache.last_persist
    assert report is not None
    assert (report.blocks, report.written, report.failed, report.timed_out) == (101, 101, 0, False)
    with Engine.load(tiny_llama_path, ec, cc, cache=build_cache(cc, ssd)) as second:
        assert second.cache is not None
        assert second.cache.stats().to_dict()["tiers"]["ssd"]["blocks_on_disk"] == 101
        r2 = second.generate(prompt, max_tokens=4)
    assert r2.usage.cached_by_tier == {"ssd": 399}
    assert r2.tokens == r1.tokens


def test_a_corrupt_index_rebuilt_by_check_fix_restores_output_equal_to_a_full_prefill(
        tiny_llama_path, tmp_path, capsys):
    """Index corruption + ``cache check --fix``: every block file is kept and indexed
    again from its own header, and a restarted engine restores the turn from them with
    output equal to a full prefill."""
    import json

    from promptcache.cli import main

    folder = tmp_path / "blocks"
    ssd = SSDConfig(path=folder, policy="write_through", fsync=False)
    ec = EngineConfig(restore_plan="load", prefill_chunk_tokens=16)
    cc = CacheConfig(block_size=8, ram_budget_bytes=64 * 1024**2)
    prompt = [int(t) for t in np.random.default_rng(11).integers(3, 1000, size=30)]
    with Engine.load(tiny_llama_path, ec, cc, cache=build_cache(cc, ssd)) as first:
        first.generate(prompt, max_tokens=4)
    files = sorted(p.name for p in folder.rglob("*.safetensors"))
    assert files
    index = folder / "index.sqlite"
    for suffix in ("-wal", "-shm"):
        (folder / f"index.sqlite{suffix}").unlink(missing_ok=True)
    index.write_bytes(b"this is not a database" * 100)
    assert main(["cache", "check", "--fix", "--cache-dir", str(folder)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["index_rebuilt"] and report["recovered_blocks"] == len(files)
    assert sorted(p.name for p in folder.rglob("*.safetensors")) == files
    with Engine.load(tiny_llama_path, ec, cc, cache=build_cache(cc, ssd)) as second:
        again = second.generate(prompt, max_tokens=4)
        ref = second.generate(prompt, max_tokens=4, use_cache=False)
    assert again.usage.cached_tokens == 29 and again.usage.cached_by_tier == {"ssd": 29}
    assert again.tokens == ref.tokens
