"""Live session state (engine/payload/live.py): a next turn continues from the previous turn's
caches, kept as the model's own objects, and its output equals a full prefill; what a
retry, a hybrid's branch, memory pressure, an overlap and another server do with it.

The architecture matrix (test_matrix.py, point ``live``) runs the next turns of every
family from their live state, alone and batched; these are the cases around it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import BLOCK, LogitsRecorder, make_engine
from models.tiny_families import ensure_family_model

from promptcache.cli.wiring import build_cache
from promptcache.config import CacheConfig, SSDConfig
from promptcache.engine.api import GenerationRequest, SamplingParams
from promptcache.engine.engine import Engine
from promptcache.serving_config import EngineConfig

TOL = 1e-4  # relative |logits - a full prefill's|: float32 noise


def _prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 1000, size=n)]


def _run(eng: Engine, prompt: list[int], rid: str, *, use_cache: bool = True,
         session: str | None = None, max_tokens: int = 5) -> tuple[list[int], dict[str, int],
                                                                  list[np.ndarray]]:
    """(tokens, cached tokens by tier, logits per step) of one greedy request."""
    r = eng.submit(GenerationRequest(prompt_tokens=tuple(prompt),
                                     sampling=SamplingParams(max_tokens=max_tokens),
                                     use_cache=use_cache, request_id=rid,
                                     session_id=session)).result(timeout=300)
    assert r.finish_reason == "length", r
    return list(r.tokens), dict(r.usage.cached_by_tier), eng.recorder.by_request.pop(rid)


def _equal_to_full_prefill(eng: Engine, prompt: list[int], got: list[int],
                           logits: list[np.ndarray], rid: str) -> None:
    ref, _, ref_logits = _run(eng, prompt, rid + "-ref", use_cache=False, max_tokens=len(got))
    assert got == ref
    for a, b in zip(logits, ref_logits, strict=True):
        a, b = np.asarray(a, np.float32).ravel(), np.asarray(b, np.float32).ravel()
        assert float(np.max(np.abs(a - b))) / max(1.0, float(np.max(np.abs(b)))) <= TOL


@pytest.fixture(scope="module")
def hybrid_path(models_root: Path) -> Path:
    return ensure_family_model("qwen3_5", models_root)


def test_a_retry_trims_the_live_state_and_equals_a_full_prefill(tiny_llama_path):
    eng = make_engine(tiny_llama_path)
    try:
        p = _prompt(1, 40)
        first, by_tier, _ = _run(eng, p, "t1")
        assert by_tier == {}
        s = eng.engine_stats()
        layers = len(eng._ctx.model.layers)
        # arrays held (Metal caps their number): k and v per layer in the live state; one
        # buffer per RAM block (5 of the prompt, the reply's partial one)
        assert (s["live_states"], s["live_arrays"], s["ram_arrays"]) == (1, 2 * layers, 6)
        # the client retries the same request: the state holds prompt + reply[:-1]; it is
        # trimmed to all but the prompt's last token (which runs again for its logits)
        again, by_tier, logits = _run(eng, p, "retry")
        assert by_tier == {"live": 39}
        assert again == first
        _equal_to_full_prefill(eng, p, again, logits, "retry")
        s = eng.engine_stats()
        assert (s["live_taken"], s["live_trimmed"], s["live_tokens"]) == (1, 1, 39)
        # the next turn extends the retry's state exactly: nothing trimmed
        nxt = p + again + _prompt(2, 20)
        toks, by_tier, logits = _run(eng, nxt, "t2")
        assert by_tier == {"live": 40 + 5 - 1}
        _equal_to_full_prefill(eng, nxt, toks, logits, "t2")
        s = eng.engine_stats()
        assert (s["live_taken"], s["live_trimmed"]) == (2, 1)
    finally:
        eng.close()


def test_a_hybrid_continues_only_an_exact_extension(hybrid_path):
    eng = make_engine(hybrid_path)
    try:
        p = _prompt(3, 40)
        first, _, _ = _run(eng, p, "t1")
        # a retry cannot trim an array (SSM) state: the blocks' state snapshot serves it
        again, by_tier, logits = _run(eng, p, "retry")
        assert "live" not in by_tier and sum(by_tier.values()) > 0
        _equal_to_full_prefill(eng, p, again, logits, "retry")
        # the first turn's state is still there, and the next turn extends it exactly
        nxt = p + first + _prompt(4, 20)
        toks, by_tier, logits = _run(eng, nxt, "t2")
        assert by_tier == {"live": 40 + 5 - 1}
        _equal_to_full_prefill(eng, nxt, toks, logits, "t2")
        assert eng.engine_stats()["live_trimmed"] == 0
    finally:
        eng.close()


def test_memory_pressure_releases_live_states_before_active_blocks(tiny_llama_path, tmp_path):
    cc = CacheConfig(block_size=BLOCK, ram_budget_bytes=64 * 1024**2)
    cache = build_cache(cc, SSDConfig(path=tmp_path / "blocks", policy="write_back",
                                      fsync=False))
    eng = Engine.load(tiny_llama_path, EngineConfig(restore_plan="load", prefill_chunk_tokens=16,
                                                    spec_verify_cost=(1.0, 0.0)), cc,
                      cache=cache, logits_hook=LogitsRecorder())
    eng.recorder = eng._ctx.logits_hook
    try:
        other = _prompt(17, 24)  # another conversation's blocks: idle, they go first
        _run(eng, other, "other")
        idle_bytes = cache.stats().ram_bytes
        p = _prompt(5, 40)
        first, _, _ = _run(eng, p, "t1", session="s")
        # the server marks the session's latest chain active after each reply
        assert eng.cache_port.mark_active(p + first[:-1], "default", "s") > 0
        live_bytes = eng.engine_stats()["live_bytes"]
        ram_bytes = cache.stats().ram_bytes - idle_bytes
        assert eng.engine_stats()["live_states"] == 2
        assert live_bytes > 0 and ram_bytes > 0
        assert cache.pool.outside_bytes == live_bytes
        # the memory governor (autotune) shrinks the RAM tier to what the active chain
        # holds: the idle blocks go first, then the live states, the active blocks stay
        assert cache.resize_ram(ram_bytes) == ram_bytes
        s = eng.engine_stats()
        assert (s["live_states"], s["live_bytes"], s["live_reclaimed"]) == (0, 0, 2)
        assert cache.pool.outside_bytes == 0 and cache.stats().ram_bytes == ram_bytes
        # mid-conversation, the next turn restores from the blocks instead
        nxt = p + first + _prompt(6, 20)
        toks, by_tier, logits = _run(eng, nxt, "t2", session="s")
        assert by_tier == {"ram": 44}
        _equal_to_full_prefill(eng, nxt, toks, logits, "t2")
        # the RAM tier is full of active blocks: the new state does not fit and is not
        # kept (nothing of the tier is evicted for it)
        s = eng.engine_stats()
        assert (s["live_states"], s["live_not_kept"]) == (0, 1)
    finally:
        eng.close()


def test_overlapping_requests_of_one_session_take_the_state_once(tiny_llama_path):
    eng = make_engine(tiny_llama_path)
    try:
        p = _prompt(8, 40)
        first, _, _ = _run(eng, p, "t1", session="s")
        nxt = p + first + _prompt(9, 20)
        reqs = [GenerationRequest(prompt_tokens=tuple(nxt), request_id=f"o{i}",
                                  sampling=SamplingParams(max_tokens=5), session_id="s")
                for i in range(2)]
        handles = [eng.submit(r) for r in reqs]
        results = [h.result(timeout=300) for h in handles]
        tiers = sorted(tuple(r.usage.cached_by_tier) for r in results)
        # one continues from the live state, the other restores the same prefix from blocks
        assert tiers == [("live",), ("ram",)]
        assert [r.usage.cached_tokens for r in results] == [44, 44]
        assert results[0].tokens == results[1].tokens
        for req, r in zip(reqs, results, strict=True):
            logits = eng.recorder.by_request.pop(req.request_id)
            _equal_to_full_prefill(eng, nxt, list(r.tokens), logits, req.request_id)
        # both kept their state; the next turn takes one of them
        assert eng.engine_stats()["live_states"] == 2
    finally:
        eng.close()


def test_another_server_restores_from_the_shared_tier_and_the_first_goes_on(
        tiny_llama_path, tmp_path):
    """Server A serves turn 1 (its live state), server B, over the same SSD folder, turn 2
    (from A's blocks); A then serves turn 3: B's blocks reach further than A's own live
    state of turn 1, so they are restored instead."""
    cc = CacheConfig(block_size=BLOCK, ram_budget_bytes=64 * 1024**2)
    ssd = SSDConfig(path=tmp_path / "blocks", policy="write_through", fsync=False)
    ec = EngineConfig(restore_plan="load", prefill_chunk_tokens=16, spec_verify_cost=(1.0, 0.0))
    rec = LogitsRecorder
    a = Engine.load(tiny_llama_path, ec, cc, cache=build_cache(cc, ssd), logits_hook=rec())
    b = Engine.load(tiny_llama_path, ec, cc, cache=build_cache(cc, ssd), logits_hook=rec())
    a.recorder, b.recorder = a._ctx.logits_hook, b._ctx.logits_hook
    try:
        p1 = _prompt(10, 40)
        o1, _, _ = _run(a, p1, "a1")
        assert a.cache.flush(timeout=30)
        p2 = p1 + o1 + _prompt(11, 20)
        o2, by_tier, logits = _run(b, p2, "b2")
        assert by_tier == {"ssd": 44}
        _equal_to_full_prefill(b, p2, o2, logits, "b2")
        assert b.cache.flush(timeout=30)
        p3 = p2 + o2 + _prompt(12, 20)
        o3, by_tier, logits = _run(a, p3, "a3")
        # A's own RAM blocks of turn 1 (5 whole ones), then B's chain from the SSD up to
        # turn 2's prompt + reply[:-1] (65 + 4 tokens)
        assert by_tier == {"ram": 40, "ssd": 29}
        _equal_to_full_prefill(a, p3, o3, logits, "a3")
        # A's turn-1 state was not used (the blocks reached further) and stays until
        # replaced or reclaimed; the third turn's state is kept beside it
        s = a.engine_stats()
        assert (s["live_taken"], s["live_states"]) == (0, 2)
    finally:
        a.close()
        b.close()


def test_live_states_off_restores_from_blocks_and_counts_the_copies(tiny_llama_path):
    from promptcache.engine.payload import adapters
    from promptcache.engine.payload.kv_size import probe_caches

    eng = make_engine(tiny_llama_path, live_states=0)
    try:
        p = _prompt(13, 40)
        first, _, _ = _run(eng, p, "t1")
        toks, by_tier, _ = _run(eng, p + first + _prompt(14, 20), "t2")
        assert by_tier == {"ram": 44}
        s = eng.engine_stats()
        assert "live_states" not in s
        # 44 tokens from 6 blocks (5 of 8 tokens + one of 4). Turn 1's prompt was saved
        # as two 16-token chunks (each a slab of two rows) and one block, the reply's
        # blocks one by one. Per layer, k and v are each one concatenation of 5 parts:
        # the two slabs' rows (a strided copy each), the fifth block, the partial one
        # (its 4 tokens padded to a block) and the room for the 21 new tokens and the
        # first output in whole blocks (44 + 22 -> 3 blocks past the 6): 72 positions
        arrays = [a for _, a in adapters.state_arrays(probe_caches(eng._ctx.model))]
        per_position = sum(int(a.nbytes) // int(a.shape[2]) for a in arrays)
        assert (s["restores"], s["restored_blocks"]) == (1, 6)
        assert s["restore_copies"] == 5 * len(arrays)
        assert s["restore_copy_bytes"] == 72 * per_position
    finally:
        eng.close()


def test_tenants_never_take_each_others_state(tiny_llama_path):
    eng = make_engine(tiny_llama_path)
    try:
        p = _prompt(15, 40)
        r = eng.submit(GenerationRequest(prompt_tokens=tuple(p), tenant="a", request_id="a1",
                                         sampling=SamplingParams(max_tokens=5))).result(300)
        nxt = tuple(p + list(r.tokens) + _prompt(16, 8))
        other = eng.submit(GenerationRequest(prompt_tokens=nxt, tenant="b", request_id="b1",
                                             sampling=SamplingParams(max_tokens=5))).result(300)
        assert other.usage.cached_tokens == 0 and other.usage.cached_by_tier == {}
        mine = eng.submit(GenerationRequest(prompt_tokens=nxt, tenant="a", request_id="a2",
                                            sampling=SamplingParams(max_tokens=5))).result(300)
        assert mine.usage.cached_by_tier == {"live": 44}
    finally:
        eng.close()


def test_deleting_a_session_or_a_tenant_or_evicting_all_drops_its_states(tiny_llama_path):
    eng = make_engine(tiny_llama_path)
    try:
        def turn(tenant: str, session: str, seed: int) -> None:
            eng.submit(GenerationRequest(prompt_tokens=tuple(_prompt(seed, 24)), tenant=tenant,
                                         session_id=session, request_id=f"{tenant}-{session}",
                                         sampling=SamplingParams(max_tokens=2))).result(300)

        for i, (tenant, session) in enumerate([("a", "s1"), ("a", "s2"), ("b", "s1")]):
            turn(tenant, session, 20 + i)
        cache = eng.cache
        assert eng.engine_stats()["live_states"] == 3
        held = cache.pool.outside_bytes
        cache.delete_session("s1", "a")  # tenant a's s1 only (b's s1 stays)
        assert eng.engine_stats()["live_states"] == 2
        assert cache.pool.outside_bytes == eng.engine_stats()["live_bytes"] < held
        cache.delete("b")
        assert eng.engine_stats()["live_states"] == 1
        cache.evict()  # everything: the blocks and every live state
        s = eng.engine_stats()
        assert (s["live_states"], s["live_reclaimed"], cache.pool.outside_bytes) == (0, 3, 0)
    finally:
        eng.close()


def test_a_state_older_than_the_cache_ttl_is_not_used(tiny_llama_path):
    from promptcache.cache import PromptCache
    from promptcache.engine.payload.payload import MLXPayloadAdapter

    now = [0.0]
    cache = PromptCache(CacheConfig(block_size=BLOCK, ram_budget_bytes=64 * 1024**2,
                                    ttl_seconds=60.0),
                        adapter=MLXPayloadAdapter(), clock=lambda: now[0])
    eng = Engine.load(tiny_llama_path, EngineConfig(restore_plan="load", prefill_chunk_tokens=16,
                                                    spec_verify_cost=(1.0, 0.0)),
                      CacheConfig(block_size=BLOCK), cache=cache, logits_hook=LogitsRecorder())
    eng.recorder = eng._ctx.logits_hook
    try:
        p = _prompt(30, 40)
        first, _, _ = _run(eng, p, "t1")
        now[0] = 61.0  # the blocks and the state have expired
        _, by_tier, _ = _run(eng, p + first + _prompt(31, 8), "t2")
        assert by_tier == {}
        s = eng.engine_stats()
        assert (s["live_expired"], s["live_taken"], s["live_states"]) == (1, 0, 1)
        assert cache.pool.outside_bytes == s["live_bytes"]
    finally:
        eng.close()
