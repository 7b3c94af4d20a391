"""Shadow verification: a restored block whose payload was replaced by another valid
payload of the same shape (the checksum cannot see it) is detected by recomputing it,
its chain is quarantined in every tier, counted, and the alert raised; correct hits
pass. The quarantine itself is checked on the cache core."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from promptcache.cache import PromptCache
from promptcache.config import CacheConfig, SSDConfig
from promptcache.meta import Namespace
from promptcache.serving_config import EngineConfig
from promptcache.tiers.ssd import SSDTier

BS = 8


def _payload(start: int, end: int, snapshot: bool) -> dict[str, np.ndarray]:
    return {"0.k": np.full((1, 1, end - start, 2), float(start), dtype=np.float32)}


def test_quarantine_removes_the_chain_from_a_block_in_every_tier(tmp_path: Path) -> None:
    ns = Namespace("m", 4)
    tier = SSDTier(SSDConfig(path=tmp_path / "ssd", fsync=False))
    cache = PromptCache(CacheConfig(block_size=4, ram_budget_bytes=1 << 20), lower=[tier],
                        write_through=True)
    a = list(range(100, 118))  # 4 full blocks + a 2-token tail
    b = a[:8] + list(range(300, 310))  # shares the first two blocks
    cache.store(ns, a, len(a), _payload)
    cache.store(ns, b, len(b), _payload)
    assert cache.flush(30)
    third = cache.lookup(a, ns).blocks[2]
    cache.evict(3)  # some of the chain only on the SSD now
    assert cache.quarantine_chain(third.block_hash, ns) == 3  # blocks 2, 3 and the tail
    assert cache.lookup(a + [1], ns).num_tokens == 8
    assert cache.lookup(b + [1], ns).num_tokens == len(b)  # the sibling chain is intact
    assert tier.get_meta(third.block_hash, ns=ns) is None
    cache.close(persist=False)


def _engine(path: Path, *, fraction: float = 0.0, ssd: Path | None = None):  # type: ignore[no-untyped-def]
    from promptcache.cli.wiring import build_cache
    from promptcache.engine.engine import Engine

    cfg = CacheConfig(block_size=BS, ram_budget_bytes=64 * 1024**2)
    ssd_cfg = SSDConfig(path=ssd, fsync=False, policy="write_through") if ssd else None
    # shadow verification checks hits of blocks: no live state serves the next turns
    # the restore planner pinned (tests never depend on timing): hits are loaded, checked
    return Engine.load(path, EngineConfig(prefill_chunk_tokens=16, restore_plan="load",
                                          shadow_verify_fraction=fraction, live_states=0),
                       cfg, cache=build_cache(cfg, ssd_cfg))


def _tokens(n: int, seed: int) -> list[int]:
    return [5 + (i * 31 + seed * 977) % 1000 for i in range(n)]


def _drain(verifier) -> int:  # type: ignore[no-untyped-def]
    steps = 0
    while verifier.step():
        steps += 1
    return steps


def test_shadow_catches_a_swapped_valid_payload(tiny_llama_path: Path) -> None:
    from promptcache.engine.payload.shadow import ShadowVerifier

    eng = _engine(tiny_llama_path)
    try:
        cache = eng.cache
        ns = eng.namespace("default")
        a, b = _tokens(40, 1), _tokens(40, 2)
        eng.generate(a, max_tokens=2)
        eng.generate(b, max_tokens=2)
        shadow = ShadowVerifier(eng.model, cache, fraction=1.0, chunk_tokens=16)
        cache.observers.append(shadow)
        # a correct hit passes
        eng.generate(a + [7, 8, 9], max_tokens=1)
        assert shadow.pending and _drain(shadow) >= 3  # 40 tokens in chunks of 16 + compare
        assert (shadow.counts["checked"], shadow.counts["matched"],
                shadow.counts["mismatches"]) == (1, 1, 0)
        # swap A's block [16, 24) for B's: same shape, a valid payload, the checksum of
        # the bytes written would be right
        blocks_a = cache.lookup(a, ns).blocks
        blocks_b = cache.lookup(b, ns).blocks
        victim = cache.pool.get(blocks_a[2].block_hash)
        donor = cache.pool.get(blocks_b[2].block_hash)
        assert {k: v.shape for k, v in victim.payload.items()} == \
            {k: v.shape for k, v in donor.payload.items()}
        victim.payload = dict(donor.payload)
        eng.generate(a + [4, 5, 6], max_tokens=1)  # restores the swapped block
        assert shadow.pending
        _drain(shadow)
        assert shadow.counts["mismatches"] == 1 and shadow.alerting
        assert shadow.counts["quarantined_blocks"] >= 3  # [16, 24), [24, 32), ... on
        assert shadow.last_mismatch is not None and shadow.last_mismatch["start"] == 16
        assert cache.lookup(a + [4, 5, 6], ns).num_tokens == 16  # cut where it was wrong
        assert cache.lookup(b + [1], ns).num_tokens == 40  # B untouched
    finally:
        eng.close()


def test_correct_hits_pass_for_every_cache_kind(tiny_kind_and_path) -> None:  # type: ignore[no-untyped-def]
    from promptcache.engine.payload.shadow import ShadowVerifier

    kind, path = tiny_kind_and_path
    eng = _engine(path)
    try:
        shadow = ShadowVerifier(eng.model, eng.cache, fraction=1.0, chunk_tokens=16)
        eng.cache.observers.append(shadow)
        a = _tokens(48, 3)
        eng.generate(a, max_tokens=3)
        eng.generate(a + [9, 10, 11, 12], max_tokens=1)
        _drain(shadow)
        assert shadow.counts["checked"] >= 1, (kind, shadow.snapshot())
        assert shadow.counts["mismatches"] == 0 and not shadow.alerting, (kind, shadow.snapshot())
    finally:
        eng.close()


def test_in_the_engine_a_swapped_ssd_payload_is_caught_in_idle_time_only(
        tiny_llama_path: Path, tmp_path: Path) -> None:
    """The engine verifies every hit (fraction 1) between requests: the SSD copy of a
    block is replaced by another block's payload re-labelled with its hash (the
    checksum of the bytes written is valid); the next hit restores it, the verifier
    catches it, quarantines the chain in RAM and on the SSD, counts it, raises the
    alert; and no verification chunk ever ran while a request was active or waiting."""
    import time

    from promptcache import codec
    from promptcache.engine.api import GenerationRequest, SamplingParams
    from promptcache.engine.payload.payload import MLXPayloadAdapter

    eng = _engine(tiny_llama_path, fraction=1.0, ssd=tmp_path / "ssd")
    try:
        cache, shadow = eng.cache, eng.shadow
        assert shadow is not None and shadow in cache.observers
        seen: list[bool] = []
        advance = shadow._advance

        def recording(job):  # type: ignore[no-untyped-def]
            seen.append(eng.scheduler.idle and not eng.admission.has_ready)
            return advance(job)

        shadow._advance = recording  # type: ignore[method-assign]
        ns = eng.namespace("default")
        a, b = _tokens(40, 1), _tokens(40, 2)
        eng.generate(a, max_tokens=2)
        eng.generate(b, max_tokens=2)
        assert cache.flush(60)
        victim = cache.lookup(a, ns).blocks[2]
        donor = cache.pool.get(cache.lookup(b, ns).blocks[2].block_hash)
        ad = MLXPayloadAdapter()
        buffer, layout = ad.to_buffer(donor.payload)
        forged = codec.encode(victim, (), layout, buffer)
        ssd = cache.lower[0]
        assert ssd.put(victim, forged, timeout=None) and ssd.flush(60)
        cache.evict()  # every block now comes back from the SSD
        # the hit that restores the forged block, and more requests right behind it
        handles = [eng.submit(GenerationRequest(prompt_tokens=tuple(p),
                                                sampling=SamplingParams(max_tokens=3)))
                   for p in (a + [4, 5, 6], _tokens(60, 5), _tokens(50, 6), b + [7])]
        results = [h.result(timeout=300) for h in handles]
        assert results[0].usage.cached_tokens == 40 and results[0].usage.cached_by_tier.get("ssd")
        deadline = time.monotonic() + 300
        while shadow.pending and time.monotonic() < deadline:
            time.sleep(0.05)  # waits for a condition (the verifier's queue), with a deadline
        snap = shadow.snapshot()
        assert snap["mismatches"] == 1 and snap["alerting"], snap
        assert snap["last_mismatch"]["start"] == 16 and snap["quarantined_blocks"] >= 3
        assert snap["checked"] >= 2 and snap["matched"] >= 1  # B's hit was fine
        assert cache.lookup(a + [4, 5, 6], ns).num_tokens == 16
        assert ssd.get_meta(victim.block_hash, ns=ns) is None  # gone from the SSD too
        assert seen and all(seen), seen  # never while a request was active or waiting
    finally:
        eng.close()


def test_shadow_verification_with_quantized_blocks_is_refused_at_load(
        tiny_llama_path: Path) -> None:
    """A quantized block differs from its recomputation by the quantization error, past
    the verifier's tolerance: the combination is refused instead of quarantining every hit."""
    import pytest

    from promptcache.cli.wiring import build_cache
    from promptcache.engine.engine import Engine

    cfg = CacheConfig(block_size=BS, ram_budget_bytes=64 * 1024**2, kv_bits=8)
    with pytest.raises(ValueError, match="does not support quantized KV blocks"):
        Engine.load(tiny_llama_path, EngineConfig(shadow_verify_fraction=0.5), cfg,
                    cache=build_cache(cfg, None))
