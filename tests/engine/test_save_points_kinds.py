"""Save points on the sliding-window and hybrid (non-truncatable) tiny models."""

from __future__ import annotations

import numpy as np
import pytest
from stepper import Stepper


def _toks(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 1000, size=n)]


def _cancel_after_chunks(eng, prompt, chunks):
    st = Stepper(eng)
    run = st.submit(prompt, max_tokens=4)
    for _ in range(chunks):  # the first step also does the lookup
        st.step()
    run.cancel()
    st.step()
    assert run.result.finish_reason == "cancelled"
    assert st.step() is False
    return run.result


@pytest.mark.parametrize("every, chunks, expect_hit", [(1, 2, 32), (4, 1, 0), (4, 2, 32), (2, 3, 48), (4, 3, 32)])
def test_hybrid_snapshot_policy_on_cancel(tiny_hybrid_path, engine_factory, every, chunks, expect_hit):
    """snapshot_every_blocks=k: a mid-prefill snapshot once a chunk reaches a multiple of k blocks."""
    eng = engine_factory(tiny_hybrid_path, snapshot_every_blocks=every)
    prompt = [990] + _toks(55, 10 + every + chunks)
    res = _cancel_after_chunks(eng, prompt, chunks)
    assert res.usage.saved_mid_prefill == 2 * chunks
    again = eng.generate(prompt, max_tokens=3)
    assert again.usage.cached_tokens == expect_hit
    assert again.tokens == eng.generate(prompt, max_tokens=3, use_cache=False).tokens


def test_hybrid_turn_two_hits_end_of_generation_snapshot(tiny_hybrid_path, engine_factory):
    eng = engine_factory(tiny_hybrid_path)
    prompt = [991] + _toks(20, 77)
    t1 = eng.generate(prompt, max_tokens=5)
    assert t1.finish_reason == "length"
    # the exact prompt again: the end-of-prompt snapshot (21) cannot be used (the last
    # token must re-run); the mid-prefill snapshot at 16 can
    assert eng.generate(prompt, max_tokens=2).usage.cached_tokens == 16
    turn2 = prompt + t1.tokens + _toks(6, 78)
    t2 = eng.generate(turn2, max_tokens=3)
    assert t2.usage.cached_tokens == len(prompt) + 4  # prompt + output[:-1]
    assert t2.tokens == eng.generate(turn2, max_tokens=3, use_cache=False).tokens


def test_sliding_window_stores_output_blocks_during_decode(tiny_gemma_path, engine_factory):
    eng = engine_factory(tiny_gemma_path, live_states=0)  # the turn restores the blocks
    prompt = [992] + _toks(9, 79)  # 10 tokens; the window is 16
    t1 = eng.generate(prompt, max_tokens=40)
    n = len(prompt) + len(t1.tokens) - 1
    # end_prefill: [0, 8) + [8, 10); decode: every completed block [8,16) ... ; end: the tail
    assert t1.usage.saved_end_prefill == 2
    assert t1.usage.saved_end_generation == n // 8 - 1 + (1 if n % 8 else 0)
    turn2 = prompt + t1.tokens + _toks(5, 80)
    t2 = eng.generate(turn2, max_tokens=3)
    assert t2.usage.cached_tokens == n
    assert t2.tokens == eng.generate(turn2, max_tokens=3, use_cache=False).tokens
