"""The restore-or-recompute planner in the engine: an SSD-held prefix recomputed or
loaded as the (injected) rates say, the output equal to a full prefill either way; the
plan counted, logged in the usage and measured online."""

from __future__ import annotations

import numpy as np
import pytest
from test_planner import rates

from promptcache.cli.wiring import build_cache
from promptcache.config import CacheConfig, SSDConfig
from promptcache.engine.engine import Engine
from promptcache.serving_config import EngineConfig

CC = CacheConfig(block_size=8, ram_budget_bytes=64 * 1024**2)


def _write(path, tmp_path, prompt):
    """A first engine writes the prompt's blocks through to the SSD; returns its tokens."""
    ssd = SSDConfig(path=tmp_path / "blocks", policy="write_through", fsync=False)
    with Engine.load(path, EngineConfig(prefill_chunk_tokens=16), CC,
                     cache=build_cache(CC, ssd)) as first:
        return ssd, first.generate(prompt, max_tokens=6).tokens


def _prompt(seed: int, n: int = 30) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 1000, size=n)]


def test_a_slow_ssd_is_recomputed_and_the_tokens_equal_a_full_prefill(tiny_llama_path,
                                                                       tmp_path):
    prompt = _prompt(21)
    ssd, want = _write(tiny_llama_path, tmp_path, prompt)
    with Engine.load(tiny_llama_path, EngineConfig(prefill_chunk_tokens=16), CC,
                     cache=build_cache(CC, ssd)) as eng:
        # prefill nearly free, the SSD one second per byte: recompute the 29 tokens
        eng.planner.rates = rates(1e-9, reads={"ssd": (1.0, 1.0)})
        r = eng.generate(prompt, max_tokens=6)
        ref = eng.generate(prompt, max_tokens=6, use_cache=False)
        stats = eng.stats()
    assert r.tokens == ref.tokens == want
    assert r.usage.cached_tokens == 0 and r.usage.cached_by_tier == {}
    assert r.usage.recomputed_tokens == 29
    assert r.usage.restore_plan.startswith("recompute/auto[0:29:29],load=")
    e = stats["engine"]
    assert e["restore_plans_by_kind"] == {"recompute": 1}
    assert e["restore_plans_by_why"] == {"auto": 1}
    assert e["recomputed_tokens"] == 29 and e["restores"] == 0
    assert stats["cache"]["promotions"] == 0  # nothing read from the SSD


def test_a_fast_ssd_is_loaded_and_its_read_measured(tiny_llama_path, tmp_path):
    prompt = _prompt(22)
    ssd, want = _write(tiny_llama_path, tmp_path, prompt)
    with Engine.load(tiny_llama_path, EngineConfig(prefill_chunk_tokens=16), CC,
                     cache=build_cache(CC, ssd)) as eng:
        eng.planner.rates = rates(1.0, reads={"ssd": (0.0, 1e-12)})
        r = eng.generate(prompt, max_tokens=6)
        stats = eng.stats()
    assert r.tokens == want
    assert r.usage.cached_by_tier == {"ssd": 29}
    assert r.usage.restore_plan.startswith("load/auto[0:0:29],load=")
    e = stats["engine"]
    assert e["restore_plans_by_kind"] == {"load": 1} and e["recomputed_tokens"] == 0
    assert e["rate_read_samples"] == 1 and stats["cache"]["promotions"] == 4


def test_unmeasured_rates_load_then_learn_from_the_read_and_the_prefill(tiny_llama_path,
                                                                       tmp_path):
    prompt = _prompt(23)
    ssd, want = _write(tiny_llama_path, tmp_path, prompt)
    with Engine.load(tiny_llama_path, EngineConfig(prefill_chunk_tokens=16), CC,
                     cache=build_cache(CC, ssd)) as eng:
        r = eng.generate(prompt, max_tokens=6)
        e = eng.engine_stats()
    assert r.tokens == want and r.usage.cached_by_tier == {"ssd": 29}
    assert r.usage.restore_plan == "load/unmeasured[0:0:29]"
    assert e["restore_plans_by_why"] == {"unmeasured": 1}
    # one SSD read, one restore and the prompt's last token's chunk were measured
    assert e["rate_read_samples"] == 1 and e["rate_prefill_samples"] >= 1
    snap = e["restore_rates"]
    assert snap["reads"]["ssd"]["samples"] == 1 and snap["restore"]["samples"] == 1


@pytest.mark.parametrize("policy", ["load", "recompute"])
def test_a_forced_policy_is_taken_whatever_the_rates(tiny_llama_path, tmp_path, policy):
    prompt = _prompt(24)
    ssd, want = _write(tiny_llama_path, tmp_path, prompt)
    with Engine.load(tiny_llama_path, EngineConfig(prefill_chunk_tokens=16,
                                                   restore_plan=policy), CC,
                     cache=build_cache(CC, ssd)) as eng:
        r = eng.generate(prompt, max_tokens=6)
    assert r.tokens == want
    assert r.usage.restore_plan == (f"{policy}/forced[0:{0 if policy == 'load' else 29}:29]")
    assert r.usage.cached_by_tier == ({"ssd": 29} if policy == "load" else {})


@pytest.mark.parametrize("kind", ["hybrid", "gemma3_text"])
def test_a_hybrid_or_sliding_window_model_always_loads(tiny_model_path, tmp_path, kind):
    """State snapshots: a head recomputed under a loaded tail would not be the state the
    tail's snapshot continues, so a hybrid (SSM + KV) model's plan is load-only; so is a
    sliding window's (its restored window is the tail's alone)."""
    path = tiny_model_path(kind)
    prompt = _prompt(25, 40)
    ssd, want = _write(path, tmp_path, prompt)
    with Engine.load(path, EngineConfig(prefill_chunk_tokens=16,
                                        restore_plan="recompute"), CC,
                     cache=build_cache(CC, ssd)) as eng:
        assert eng.planner.qualifies is False
        eng.planner.rates = rates(1e-9, reads={"ssd": (1.0, 1.0)})
        r = eng.generate(prompt, max_tokens=6)
    assert r.tokens == want
    assert r.usage.restore_plan.startswith("load/stateful[0:0:")
    assert r.usage.cached_by_tier.get("ssd", 0) > 0


def test_engine_config_checks_the_policy():
    with pytest.raises(ValueError, match="restore_plan must be auto, load or recompute"):
        EngineConfig(restore_plan="fast")


def _split_rates(eng, prompt):
    """Prefill 10 ms a token, the SSD 80 ms a block of 8 (the stored reply filled the
    last one): for 29 cached tokens load-only takes 0.32 s, recompute-only 0.29 s, the
    split at 16 0.16 s (16 tokens prefilled while 2 blocks load)."""
    m = eng.cache.lookup(prompt, eng.namespaces())
    per_byte = 0.08 / m.blocks[0].nbytes
    assert {b.nbytes for b in m.blocks} == {m.blocks[0].nbytes} and len(m.blocks) == 4
    return rates(0.01, reads={"ssd": (0.0, per_byte)})


def test_the_split_prefills_the_head_while_the_tail_loads(tiny_llama_path, tmp_path):
    prompt = _prompt(26)
    ssd, want = _write(tiny_llama_path, tmp_path, prompt)
    with Engine.load(tiny_llama_path, EngineConfig(prefill_chunk_tokens=16), CC,
                     cache=build_cache(CC, ssd)) as eng:
        assert eng.planner.concurrent
        eng.planner.rates = _split_rates(eng, prompt)
        r = eng.generate(prompt, max_tokens=6)
        ref = eng.generate(prompt, max_tokens=6, use_cache=False)
        stats = eng.stats()
    assert r.tokens == ref.tokens == want
    assert r.usage.restore_plan == "split/auto[0:16:29],load=0.320s,recompute=0.290s,split=0.160s"
    assert r.usage.cached_tokens == 13 and r.usage.cached_by_tier == {"ssd": 13}
    assert r.usage.recomputed_tokens == 16
    assert r.usage.served_by_tier == {"ssd": 13, "recompute": 16}
    e = stats["engine"]
    assert (e["splices"], e["spliced_tokens"], e["splices_late"], e["splices_given_up"]) \
        == (1, 13, 0, 0)
    assert e["restore_plans_by_kind"] == {"split": 1} and e["recomputed_tokens"] == 16
    assert stats["cache"]["promotions"] == 0  # the tail was read apart from the cache
    # the split's measured time fitted against its parts (contention, scale)
    assert e["restore_rates"]["split"]["ssd"]["samples"] == 1


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe_lite", "deepseek_v32"])
def test_the_split_on_mla_models(tiny_llama_path, models_root, tmp_path, kind):
    """MLA: the latent as keys, the rope key as values, of two widths (deepseek_v32: a
    CacheList per layer)."""
    from models.mla_models import ensure_tiny_mla

    path = ensure_tiny_mla(kind, tiny_llama_path, models_root)
    prompt = _prompt(28)
    ssd, want = _write(path, tmp_path, prompt)
    with Engine.load(path, EngineConfig(prefill_chunk_tokens=16), CC,
                     cache=build_cache(CC, ssd)) as eng:
        assert eng.planner.qualifies
        eng.planner.rates = _split_rates(eng, prompt)
        r = eng.generate(prompt, max_tokens=6)
        ref = eng.generate(prompt, max_tokens=6, use_cache=False)
        e = eng.engine_stats()
    assert r.tokens == ref.tokens == want
    assert r.usage.restore_plan.startswith("split/auto[0:16:29]")
    assert (e["splices"], e["spliced_tokens"]) == (1, 13)


def test_a_failed_or_late_tail_read_is_prefilled(tiny_llama_path, tmp_path):
    import threading

    from promptcache.errors import TierError

    prompt = _prompt(27)
    ssd, want = _write(tiny_llama_path, tmp_path, prompt)
    release = threading.Event()
    with Engine.load(tiny_llama_path, EngineConfig(prefill_chunk_tokens=16), CC,
                     cache=build_cache(CC, ssd)) as eng:
        eng.planner.rates = _split_rates(eng, prompt)
        tier = eng.cache.lower[0]

        def broken(hashes, *, ns=None):
            raise TierError("the disk went away")

        tier.get_many = broken
        failed = eng.generate(prompt, max_tokens=6)
        e1 = eng.engine_stats()

        def stuck(hashes, *, ns=None):
            release.wait(30)
            return []

        tier.get_many = stuck
        eng.cache.evict()  # drop the RAM copies the first request stored
        late = eng.generate(prompt, max_tokens=6)
        e2 = eng.engine_stats()
        release.set()
    assert failed.tokens == late.tokens == want
    assert failed.usage.restore_plan.startswith("split/auto[0:16:29]")
    assert late.usage.restore_plan.startswith("split/auto[0:16:29]")
    assert failed.usage.cached_tokens == late.usage.cached_tokens == 0
    assert failed.usage.recomputed_tokens == late.usage.recomputed_tokens == 29
    assert (e1["splices"], e1["splices_given_up"], e1["splices_late"]) == (0, 1, 0)
    assert (e2["splices"], e2["splices_given_up"], e2["splices_late"]) == (0, 2, 1)
    # a failed read says nothing of the overlap; a late one cost the whole tail's prefill
    assert e1["restore_rates"]["split"] == {}
    assert e2["restore_rates"]["split"]["ssd"]["samples"] == 1


def test_the_tail_is_made_into_payloads_on_the_read_thread():
    """``read_tail``: a mapped segment's view goes to an adapter that copies as it is
    (no ``bytes`` copy first), to one that keeps views as a copy; a block absent,
    another block's or of a wrong count is None / a TierError."""
    from types import SimpleNamespace

    from promptcache.engine.requests.splice import read_tail
    from promptcache.errors import TierError
    from promptcache.hashing import BlockHash

    metas = [SimpleNamespace(block_hash=BlockHash(bytes([i]) * 32)) for i in range(3)]
    data = [memoryview(b"one"), memoryview(b"two")]

    class Payloads:
        def __init__(self, copies: bool) -> None:
            self.adapter = SimpleNamespace(copies_buffers=copies)
            self.items: list[tuple[object, BlockHash]] = []

        def load_many(self, items):
            self.items = list(items)
            return [(bytes(b), 3) if h == metas[0].block_hash else None for b, h in items]

    class Tier:
        def get_many(self, hashes, *, ns=None):
            assert hashes == [m.block_hash for m in metas]
            return [(data[0], []), (data[1], []), None]

    for copies in (True, False):
        p = Payloads(copies)
        got = read_tail(Tier(), metas, None, p)
        assert got == [(b"one", 3), None, None]
        assert [type(b) for b, _ in p.items] == [memoryview if copies else bytes] * 2
        assert [b == d for (b, _), d in zip(p.items, data, strict=True)] == [True, True]

    class Short(Tier):
        def get_many(self, hashes, *, ns=None):
            return [None]

    with pytest.raises(TierError, match="wrong number"):
        read_tail(Short(), metas, None, Payloads(True))
