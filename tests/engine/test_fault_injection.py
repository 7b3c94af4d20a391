"""One request never kills the engine: a failure injected at every stage of a request
(building it, cache lookup, restore, prefill, decode, sampling, saving) ends that request
alone (model stages: ``finish_reason == "error"`` with the cause; cache stages: a
miss / an unsaved turn, the reply still served), the engine stays alive and the next
request is served in full."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_engine

from promptcache.engine.api import GenerationRequest, SamplingParams
from promptcache.engine.requests import request as request_mod


def _req(seed: int, n: int = 40, max_tokens: int = 4) -> GenerationRequest:
    toks = tuple(int(t) for t in np.random.default_rng(seed).integers(3, 1000, size=n))
    return GenerationRequest(prompt_tokens=toks, sampling=SamplingParams(max_tokens=max_tokens))


class Once:
    """Wraps a callable; the ``at``-th call raises ``RuntimeError(message)``."""

    def __init__(self, fn, message: str, at: int = 1) -> None:
        self.fn, self.message, self.at, self.calls = fn, message, at, 0

    def __call__(self, *a, **k):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError(self.message)
        return self.fn(*a, **k)


@pytest.fixture()
def eng(tiny_llama_path):
    e = make_engine(tiny_llama_path, live_states=0)  # faults of the block path
    yield e
    e.close()


def _next_is_served(eng, seed: int = 99) -> None:
    good = eng.submit(_req(seed)).result(timeout=120)
    assert good.finish_reason == "length" and good.error is None
    assert len(good.tokens) == 4
    assert eng.alive and eng.failure is None


def test_a_request_that_cannot_be_built_fails_alone(eng, monkeypatch):
    monkeypatch.setattr(request_mod, "Sampler", Once(request_mod.Sampler, "bad sampler"))
    bad = eng.submit(_req(1)).result(timeout=120)
    assert bad.finish_reason == "error" and bad.error == "RuntimeError: bad sampler"
    assert eng.counters.errors == 1
    _next_is_served(eng)


def test_a_failing_cache_lookup_is_a_miss_not_a_failure(eng, monkeypatch):
    monkeypatch.setattr(eng.cache, "acquire", Once(eng.cache.acquire, "lookup broke"))
    res = eng.submit(_req(2)).result(timeout=120)
    assert res.finish_reason == "length" and res.error is None
    assert res.miss_reason is not None and res.miss_reason.startswith("cache_error")
    assert eng.counters.cache_errors == 1
    _next_is_served(eng)


def test_a_failing_restore_prefills_the_whole_prompt(eng, monkeypatch):
    eng.submit(_req(3)).result(timeout=120)  # cached
    monkeypatch.setattr(request_mod.adapters, "restore",
                        Once(request_mod.adapters.restore, "restore broke"))
    res = eng.submit(_req(3)).result(timeout=120)
    assert res.finish_reason == "length" and res.usage.cached_tokens == 0
    assert res.miss_reason is not None and res.miss_reason.startswith("restore_error")
    assert eng.counters.restore_errors == 1
    _next_is_served(eng)


def test_a_failing_save_still_answers(eng, monkeypatch):
    store = Once(eng.cache.store, "disk on fire")
    monkeypatch.setattr(eng.cache, "store", store)
    res = eng.submit(_req(4)).result(timeout=120)
    assert res.finish_reason == "length" and res.error is None and len(res.tokens) == 4
    assert store.calls >= 1
    _next_is_served(eng)


@pytest.mark.parametrize("at,stage", [(1, "prefill"), (3, "decode")])
def test_a_failing_forward_ends_only_its_request(eng, at, stage):
    real = eng.model.__call__
    flaky = Once(real, f"{stage} forward broke", at=at)

    class Flaky:
        def __getattr__(self, name):
            return getattr(eng.model, name)

        def __call__(self, *a, **k):
            return flaky(*a, **k)

    model = eng.scheduler.ctx.model
    eng.scheduler.ctx.model = Flaky()
    try:
        bad = eng.submit(_req(5)).result(timeout=120)
    finally:
        eng.scheduler.ctx.model = model
    assert bad.finish_reason == "error" and f"{stage} forward broke" in bad.error
    assert eng.counters.errors == 1
    _next_is_served(eng)


def test_a_failing_sampler_ends_only_its_request(eng, monkeypatch):
    real = request_mod.Sampler.sample
    calls = {"n": 0}

    def sample(self, logits):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("sampler broke")
        return real(self, logits)

    monkeypatch.setattr(request_mod.Sampler, "sample", sample)
    sampled = GenerationRequest(prompt_tokens=_req(6).prompt_tokens,
                                sampling=SamplingParams(max_tokens=4, temperature=0.8, seed=7))
    bad = eng.submit(sampled).result(timeout=120)
    assert bad.finish_reason == "error" and "sampler broke" in bad.error
    monkeypatch.setattr(request_mod.Sampler, "sample", real)
    _next_is_served(eng)


def test_batched_rows_fail_together_and_the_engine_goes_on(eng, monkeypatch):
    """A failure in the shared decode forward ends the rows of that batch, nothing else."""
    real = eng.model.__call__
    seen = {"batched": 0}

    class Flaky:
        def __getattr__(self, name):
            return getattr(eng.model, name)

        def __call__(self, x, *a, **k):
            if x.shape[0] > 1 and x.shape[1] == 1:
                seen["batched"] += 1
                if seen["batched"] == 1:
                    raise RuntimeError("batched decode broke")
            return real(x, *a, **k)

    monkeypatch.setattr(eng.scheduler.batch, "model", Flaky())
    handles = [eng.submit(_req(10 + i, max_tokens=8)) for i in range(3)]
    results = [h.result(timeout=120) for h in handles]
    assert seen["batched"] >= 1  # the three requests decoded in one batch
    failed = [r for r in results if r.finish_reason == "error"]
    assert failed and all("batched decode broke" in r.error for r in failed)
    assert all(r.finish_reason in ("error", "length") for r in results)
    _next_is_served(eng)


def test_an_invalid_seed_is_refused_at_submit():
    for seed in (-1, 2**64, True):
        with pytest.raises(ValueError, match="seed must be an integer"):
            SamplingParams(seed=seed)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
