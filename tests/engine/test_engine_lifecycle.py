"""The engine thread: death (pending requests fail, alive turns False, submit refuses),
close (active and waiting requests are cancelled), admission through submit."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_engine

from promptcache.engine.api import GenerationRequest, SamplingParams
from promptcache.errors import EngineDeadError, OverloadedError


def _req(n=20, seed=0, max_tokens=4, **kw):
    toks = tuple(int(t) for t in np.random.default_rng(seed).integers(3, 1000, size=n))
    return GenerationRequest(prompt_tokens=toks, sampling=SamplingParams(max_tokens=max_tokens), **kw)


def test_a_dead_engine_thread_fails_pending_requests_and_refuses_new_ones(tiny_llama_path):
    eng = make_engine(tiny_llama_path)
    try:
        assert eng.alive and eng.failure is None

        def broken():
            raise RuntimeError("scheduler bug")

        eng.scheduler.step = broken  # the next scheduler step kills the thread
        res = eng.submit(_req()).result(timeout=60)
        assert res.finish_reason == "error"
        assert "engine thread died: RuntimeError: scheduler bug" in res.error
        eng._thread.join(timeout=60)
        assert not eng.alive and eng.failure == "RuntimeError: scheduler bug"
        with pytest.raises(EngineDeadError):
            eng.submit(_req(seed=1))
    finally:
        eng.close()


def test_a_failing_model_step_ends_only_its_requests(tiny_llama_path):
    eng = make_engine(tiny_llama_path)
    try:
        real = eng.model.__call__
        calls = {"n": 0}

        class Flaky:
            def __getattr__(self, name):
                return getattr(eng.model, name)

            def __call__(self, *a, **k):
                calls["n"] += 1
                if calls["n"] == 1:
                    raise RuntimeError("out of memory")
                return real(*a, **k)

        eng.scheduler.ctx.model = Flaky()
        bad = eng.submit(_req(seed=2)).result(timeout=60)
        assert bad.finish_reason == "error" and "out of memory" in bad.error
        good = eng.submit(_req(seed=3)).result(timeout=60)
        assert good.finish_reason == "length" and eng.alive
        assert eng.counters.errors == 1
    finally:
        eng.close()


def test_overload_and_close(tiny_llama_path):
    eng = make_engine(tiny_llama_path, max_active_requests=1, max_queued_requests=1)
    try:
        eng.scheduler.step = lambda: False  # hold everything in admission
        first = eng.submit(_req(seed=4))
        second = eng.submit(_req(seed=5))
        with pytest.raises(OverloadedError) as e:
            eng.submit(_req(seed=6))
        assert e.value.retry_after_s >= 1
        snap = eng.engine_stats()
        assert (snap["active"], snap["queued"], snap["rejected"]) == (1, 1, 1)
        second.cancel()  # a waiting request is answered at once
        assert second.result(timeout=5).finish_reason == "cancelled"
    finally:
        eng.close()
    assert first.result(timeout=5).finish_reason == "cancelled"


def test_engine_stats_report_mlx_memory(tiny_llama_path):
    eng = make_engine(tiny_llama_path)
    try:
        eng.submit(_req(seed=9)).result(timeout=60)
        stats = eng.engine_stats()
        # the weights and the RAM tier's blocks are alive; the peak is at least that
        assert stats["mlx_active_bytes"] > 0
        assert stats["mlx_peak_bytes"] >= stats["mlx_active_bytes"]
        assert stats["mlx_cache_bytes"] >= 0
    finally:
        eng.close()
