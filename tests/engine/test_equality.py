"""Restored state == full prefill: for each tiny model kind, greedy outputs with the
cache equal outputs with the cache disabled, and logits agree within float32 noise.

Per kind: 20 random prompts, each followed by continuations that hit the cache by
prefix (turn 2 = prompt + output + more), exact match, supersequence (the cached
sequence is longer) and longest common prefix (diverging mid-block).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from promptcache.engine.api import GenerationRequest, SamplingParams

N_PROMPTS = 20
MAX_TOKENS = 5
TOL = 1e-4
WINDOW = 16  # the tiny gemma3_text model's sliding window (tests/models/tiny_models.py)

_ids = itertools.count()


def _run(eng, tokens, use_cache):
    rid = f"eq-{next(_ids)}"
    req = GenerationRequest(prompt_tokens=tuple(tokens), sampling=SamplingParams(max_tokens=MAX_TOKENS),
                            use_cache=use_cache, request_id=rid)
    res = eng.submit(req).result(timeout=120)
    assert res.finish_reason in ("length", "stop"), res.error
    return res, eng.recorder.by_request.pop(rid)


def _compare(eng, tokens, deltas):
    """Greedy tokens identical and logits within TOL, step by step. Restored and full
    prefills are computed in other shapes, so logits differ by float noise: where the
    reference's two best tokens lie within 2 * TOL of each other (a tie), the argmax
    may legitimately differ, and the rest of the sequence with it. Only such a tie
    excuses a different token; any other difference fails."""
    cached, lc = _run(eng, tokens, True)
    plain, lp = _run(eng, tokens, False)
    step_deltas = []
    for step, (a, b) in enumerate(zip(lc, lp, strict=False)):
        step_deltas.append(float(np.max(np.abs(a - b))))
        got, want = cached.tokens[step], plain.tokens[step]
        if got != want:
            gap = abs(float(b.reshape(-1)[want]) - float(b.reshape(-1)[got]))
            assert gap <= 2 * TOL, (len(tokens), step, got, want, gap, cached.usage)
            break  # a float tie: the two continuations differ from here on
    else:
        assert cached.tokens == plain.tokens, (len(tokens), cached.usage)
        assert len(lc) == len(lp)
    deltas.append(max(step_deltas))
    return cached


@pytest.mark.parametrize("kind", ["llama", "gemma3_text", "hybrid"])
def test_cached_generation_equals_full_prefill(kind, tiny_model_path, engine_factory):
    eng = engine_factory(tiny_model_path(kind))
    rng = np.random.default_rng(42)
    deltas: list[float] = []
    hits = {"prefix": 0, "exact": 0, "superseq": 0, "lcp": 0}
    for i in range(N_PROMPTS):
        n = int(rng.integers(5, 60))
        # a distinct first token per prompt: the first run of each is a clean miss
        prompt = [900 + i] + [int(t) for t in rng.integers(3, 1000, size=n - 1)]
        first = _compare(eng, prompt, deltas)
        assert first.usage.cached_tokens == 0
        # prefix: turn 2 = prompt + output + new tokens
        more = [int(t) for t in rng.integers(3, 1000, size=int(rng.integers(1, 30)))]
        turn2 = prompt + first.tokens + more
        r = _compare(eng, turn2, deltas)
        hits["prefix"] += r.usage.cached_tokens > 0
        if kind != "hybrid":
            # the live state of a full sliding window holds the reply's last token too
            # (engine/payload/live.py keep_position): it serves one token more than the blocks
            full = kind == "gemma3_text" and n + len(first.tokens) >= WINDOW
            assert r.usage.cached_tokens == n + len(first.tokens) - 1 + int(full)
        # exact match: the same prompt again (re-runs the last token)
        r = _compare(eng, prompt, deltas)
        hits["exact"] += r.usage.cached_tokens > 0
        if kind != "hybrid":
            assert r.usage.cached_tokens == n - 1
        # supersequence: a prefix of what is cached
        cut = max(2, n - int(rng.integers(1, 10)))
        r = _compare(eng, prompt[:cut], deltas)
        hits["superseq"] += r.usage.cached_tokens > 0
        if kind != "hybrid":
            assert r.usage.cached_tokens == cut - 1
        # longest common prefix: diverge after k tokens
        k = int(rng.integers(1, n))
        lcp = prompt[:k] + [int(t) for t in rng.integers(3, 1000, size=int(rng.integers(1, 20)))]
        if lcp[k] == prompt[k]:
            lcp[k] = 3 if prompt[k] != 3 else 4
        r = _compare(eng, lcp, deltas)
        hits["lcp"] += r.usage.cached_tokens > 0
    worst = max(deltas)
    print(f"\n[{kind}] {len(deltas)} comparisons, max |delta logits| = {worst:.3e}, hits: {hits}")
    assert worst <= TOL
    assert all(v > 0 for v in hits.values()), hits
    if kind != "hybrid":
        assert hits["prefix"] == hits["exact"] == N_PROMPTS
    else:
        # non-truncatable: turn 2 always resumes at the end-of-generation snapshot
        assert hits["prefix"] == N_PROMPTS
