"""The server's port (engine/port.py): calls that run on the engine thread (``Engine.call``)
and the cache operations built on them (predicted cached tokens, the probe's lookup,
protect, mark_active), which degrade (None / 0, counted) instead of failing a request."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import make_engine

from promptcache.engine.api import GenerationRequest, SamplingParams
from promptcache.engine.port import CachePrediction, EngineAPI
from promptcache.engine.requests.calls import EngineCallTimeout
from promptcache.errors import EngineDeadError


def _tokens(n: int = 40, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 1000, size=n)]


@pytest.fixture(scope="module")
def engine(tiny_llama_path):  # type: ignore[no-untyped-def]
    eng = make_engine(tiny_llama_path)
    yield eng
    eng.close()


def test_a_call_runs_on_the_engine_thread_and_returns_or_raises(engine) -> None:  # type: ignore[no-untyped-def]
    port: EngineAPI = engine
    assert port.cache is not None and port.cache_port.tunable_cache is engine.cache
    assert engine.call(lambda: threading.current_thread().name) == "promptcache-engine"
    with pytest.raises(KeyError):
        engine.call(lambda: {}["missing"])
    assert engine.alive  # a failing call does not hurt the engine thread


def test_predict_probe_protect_and_mark_active_go_through_the_engine_thread(engine) -> None:  # type: ignore[no-untyped-def]
    toks = _tokens(40, seed=1)
    cold = engine.cache_port.predict_cached(toks, "t-port")
    assert cold == CachePrediction(0, "cold")
    res = engine.submit(GenerationRequest(prompt_tokens=tuple(toks), tenant="t-port",
                                          sampling=SamplingParams(max_tokens=2))).result(60)
    assert res.finish_reason in ("stop", "length")
    hit = engine.cache_port.predict_cached(toks, "t-port")
    # all of it but the last token; every prompt token is stored (nothing to write)
    assert hit == CachePrediction(39, None, whole=True)
    # a prompt that diverges from the stored chain after 32 tokens
    probe = engine.cache_port.probe_cache(toks[:33] + [1] * 16, "t-port", context_tokens=8)
    assert probe is not None and probe.miss is not None
    assert (probe.num_tokens, probe.matched_tokens, dict(probe.tokens_by_tier)) == \
        (33, 33, {"ram": 33})
    assert (probe.miss.kind, probe.miss.position) == ("diverged", 33)
    # what the cache holds from there: the prompt's last 7 tokens, then the output
    assert len(probe.stored_after) == 8 and probe.stored_after[:7] == tuple(toks[33:])
    assert engine.cache_port.protect(toks, "t-port", 32, 60.0) >= 1
    assert engine.cache_port.mark_active(toks, "t-port", "s1") >= 1
    # another tenant sees nothing
    assert engine.cache_port.predict_cached(toks, "other") == CachePrediction(0, "cold")


def test_a_failing_or_late_call_degrades_and_is_counted(engine) -> None:  # type: ignore[no-untyped-def]
    before = dict(engine.calls.stats)
    assert engine.calls.degrade("a broken call", lambda: 1 // 0, None) is None
    assert engine.calls.stats["engine_calls_failed"] == before["engine_calls_failed"] + 1
    # the engine thread is busy (a slow call): the next call times out, degrades, counts
    gate = threading.Event()
    slow = threading.Thread(target=lambda: engine.call(gate.wait, timeout=30))
    slow.start()
    time.sleep(0.2)
    try:
        with pytest.raises(EngineCallTimeout):
            engine.call(lambda: 1, timeout=0.05)
        assert engine.calls.degrade("a late call", lambda: 2, -1, timeout=0.05) == -1
        assert engine.calls.stats["engine_calls_timed_out"] == \
            before["engine_calls_timed_out"] + 1
    finally:
        gate.set()
        slow.join(30)
    assert engine.call(lambda: 3) == 3  # and the engine goes on
    stats = engine.engine_stats()
    assert stats["engine_calls_timed_out"] == engine.calls.stats["engine_calls_timed_out"]


def test_calls_on_a_closed_engine_raise_at_once(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    eng = make_engine(tiny_llama_path, use_cache=False)
    assert eng.cache_port.predict_cached([1, 2, 3], "t") is None  # no cache: no prediction
    assert eng.cache_port.protect([1, 2, 3], "t", 3, 1.0) == 0 and eng.cache_port.cache_stats() is None
    eng.close()
    with pytest.raises(EngineDeadError):
        eng.call(lambda: 1)


def test_a_call_runs_while_the_engine_gathers_a_burst(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    """A request being prepared may wait for a call (its predicted cached tokens) while
    the engine waits for it to be submitted (arrivals.py): the call runs meanwhile."""
    eng = make_engine(tiny_llama_path, batch_window_s=0.05, burst_gather_max_s=10.0)
    try:
        release = eng.announce()  # a request being prepared
        handle = eng.submit(GenerationRequest(prompt_tokens=tuple(_tokens(20, seed=3)),
                                              sampling=SamplingParams(max_tokens=2)))
        time.sleep(0.2)  # the engine woke and gathers (waiting for the announced one)
        t0 = time.monotonic()
        assert eng.call(lambda: 7, timeout=5.0) == 7
        assert time.monotonic() - t0 < 1.0
        release()
        assert handle.result(60).finish_reason in ("stop", "length")
    finally:
        eng.close()
