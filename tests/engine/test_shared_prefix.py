"""Requests sent together that share a long prompt prefix compute it once
(engine/requests/scheduler.py ``_not_waiting_for_a_prefix``): the first prefills it and stores
its blocks as it goes; the others wait until it has passed the shared blocks, then
restore them. Without it (``share_prefix_min_tokens=0``) they are prefilled as one
batch and each computes the prefix again -- the shape of parallel subagents (one
system prompt + tools, each its own task).

Driven step by step (Stepper): exact cached-token counts, wait counters and step
counts; greedy tokens equal, logits within TOL, to the same prompts without the wait.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import BLOCK, CHUNK
from stepper import Stepper

TOL = 1e-4
SHARED = 80  # 10 blocks of 8, 5 chunks of 16
N = 4


def _prompts(shared=SHARED, n=N):
    rng = np.random.default_rng(7)
    head = [int(t) for t in rng.integers(3, 1000, size=shared)]
    # each its own task: 5-11 tokens, first tokens differ from each other
    return [head + [1000 + i] + [int(t) for t in rng.integers(3, 1000, size=4 + 2 * i)]
            for i in range(n)]


def _together(st, eng, prompts, **kw):
    runs = [st.submit(p, **kw) for p in prompts]
    steps = st.run()
    logits = [eng.recorder.by_request.pop(r.request.request_id) for r in runs]
    return runs, logits, steps


def _max_delta(a, b):
    assert len(a) == len(b)
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def test_a_burst_sharing_a_prefix_computes_it_once(tiny_llama_path, engine_factory):
    prompts = _prompts()
    eng = engine_factory(tiny_llama_path)
    st = Stepper(eng, share_prefix_min_tokens=CHUNK)
    runs, logits, _ = _together(st, eng, prompts)
    cached = [r.result.usage.cached_tokens for r in runs]
    assert cached == [0, SHARED, SHARED, SHARED]
    assert st.ctx.counters.shared_prefix_waits == N - 1

    # the same burst without waiting (another engine, its own empty cache)
    other = engine_factory(tiny_llama_path)
    st0 = Stepper(other, share_prefix_min_tokens=0)
    runs0, logits0, _ = _together(st0, other, prompts)
    assert [r.result.usage.cached_tokens for r in runs0] == [0] * N  # each computed it
    assert st0.ctx.counters.shared_prefix_waits == 0
    assert st0.ctx.counters.max_prefill_batch == N
    for r, r0, lg, lg0 in zip(runs, runs0, logits, logits0, strict=True):
        assert r.tokens == r0.tokens and len(r.tokens) == 6
        assert _max_delta(lg, lg0) <= TOL
    # the leader computed 80 + 5 tokens, the others only their own 5-11
    prefilled = sum(r.result.usage.prompt_tokens - r.result.usage.cached_tokens for r in runs)
    assert prefilled == sum(len(p) for p in prompts) - (N - 1) * SHARED


def test_the_wait_ends_where_the_leader_has_stored_the_shared_blocks(tiny_llama_path,
                                                                     engine_factory):
    """Followers start the step after the leader's chunk passes the last shared block;
    a shared part of less than ``share_prefix_min_tokens`` is not waited for."""
    prompts = _prompts(shared=44, n=2)  # 5 whole blocks (40 tokens) shared
    eng = engine_factory(tiny_llama_path)
    st = Stepper(eng, share_prefix_min_tokens=BLOCK)
    lead, follow = (st.submit(p) for p in prompts)
    seen = []  # (the leader's position when a step began, the follower's phase after it)
    while True:
        before = lead.req.pos if lead.req else 0
        if not st.step():
            break
        seen.append((before, follow.req.phase))
    # the follower stayed new (not started) while the leader had >= 8 shared tokens
    # left to compute, and started at the first step where it had fewer
    started_at = next(i for i, (_, ph) in enumerate(seen) if ph != "new")
    assert [40 - pos >= BLOCK for pos, _ in seen[:started_at + 1]] == [True] * started_at + [False]
    assert started_at == 3  # the leader's chunks end at 16, 32, 48 (>= 40)
    # all 44 shared tokens: the leader's block [40, 48) matches the follower's first 4
    # tokens of it (a partial-block match)
    assert follow.result.usage.cached_tokens == 44
    assert st.ctx.counters.shared_prefix_waits == 1

    small = engine_factory(tiny_llama_path)
    st2 = Stepper(small, share_prefix_min_tokens=48)  # more than the 40 shared
    runs, _, _ = _together(st2, small, prompts)
    assert [r.result.usage.cached_tokens for r in runs] == [0, 0]
    assert st2.ctx.counters.shared_prefix_waits == 0


def test_other_tenants_and_background_leaders_are_not_waited_for(tiny_llama_path,
                                                                 engine_factory):
    prompts = _prompts(n=2)
    eng = engine_factory(tiny_llama_path)
    st = Stepper(eng, share_prefix_min_tokens=CHUNK)
    a = st.submit(prompts[0], tenant="acme")
    b = st.submit(prompts[1], tenant="globex")
    st.run()
    assert [a.result.usage.cached_tokens, b.result.usage.cached_tokens] == [0, 0]
    assert st.ctx.counters.shared_prefix_waits == 0

    eng2 = engine_factory(tiny_llama_path)
    st2 = Stepper(eng2, share_prefix_min_tokens=CHUNK)
    bg = st2.submit(prompts[0], background=True, prefill_only=True)
    st2.step()  # the background request starts prefilling
    fg = st2.submit(prompts[1])
    st2.run()
    # the interactive request never waits for background work (which yields to it)
    assert st2.ctx.counters.shared_prefix_waits == 0
    assert fg.result.finish_reason == "length" and bg.result is not None


def test_a_cancelled_leader_lets_its_followers_go(tiny_llama_path, engine_factory):
    prompts = _prompts(n=3)
    eng = engine_factory(tiny_llama_path)
    st = Stepper(eng, share_prefix_min_tokens=CHUNK)
    lead, *followers = (st.submit(p) for p in prompts)
    st.step()
    st.step()  # the leader has stored 2 chunks (32 tokens)
    assert lead.req.pos == 2 * CHUNK and all(f.req.phase == "new" for f in followers)
    lead.cancel()
    st.run()
    assert lead.result.finish_reason == "cancelled"
    assert [f.result.finish_reason for f in followers] == ["length", "length"]
    # the first follower restores what the leader stored, the second waits for it
    assert followers[0].result.usage.cached_tokens == 2 * CHUNK
    assert followers[1].result.usage.cached_tokens == SHARED


def test_engine_burst_of_subagents_reuses_the_shared_prefix(tiny_llama_path,
                                                            engine_factory):
    """Through the engine thread (submit, burst gathering): however the submits
    interleave with the steps, every request after the first restores the prefix."""
    from promptcache.engine.api import GenerationRequest, SamplingParams

    prompts = _prompts()
    eng = engine_factory(tiny_llama_path, share_prefix_min_tokens=CHUNK)
    handles = [eng.submit(GenerationRequest(prompt_tokens=tuple(p),
                                            sampling=SamplingParams(max_tokens=4)))
               for p in prompts]
    results = [h.result(timeout=120) for h in handles]
    assert [r.usage.cached_tokens for r in results] == [0, SHARED, SHARED, SHARED]


@pytest.mark.parametrize("bad", [-1])
def test_share_prefix_min_tokens_is_validated(bad):
    from promptcache.serving_config import EngineConfig

    with pytest.raises(ValueError, match="share_prefix_min_tokens"):
        EngineConfig(share_prefix_min_tokens=bad)
    assert EngineConfig().share_prefix_min_tokens == 256  # docs/cli.md's figure


# ---------------------------------------------------------------- random bursts

_HEADS = {0: 40, 1: 24, 2: 56}  # three shared prefixes (tokens)


def _head(i):
    rng = np.random.default_rng(50 + i)
    return [int(t) for t in rng.integers(3, 1000, size=_HEADS[i])]


def test_random_bursts_always_finish_and_equal_each_request_alone(tiny_llama_path,
                                                                  engine_factory):
    """Random arrivals (shared prefixes, tenants, lengths, arrival steps) and
    cancellations, stepped until idle: every request ends within a bounded number of
    steps (nobody waits for a prefix forever), the ones not cancelled yield the greedy
    tokens they yield alone without a cache, and a request never restores more than
    the tokens its prompt shares with what was sent before it."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as hs

    eng = engine_factory(tiny_llama_path)
    ref = engine_factory(tiny_llama_path, use_cache=False)
    alone: dict[tuple[int, ...], list[int]] = {}

    def reference(tokens, max_tokens):
        key = (*tokens, -max_tokens)
        if key not in alone:
            s = Stepper(ref)
            run = s.submit(tokens, max_tokens=max_tokens, use_cache=False)
            s.run()
            alone[key] = run.tokens
        return alone[key]

    one = hs.tuples(hs.sampled_from([0, 1, 2, None]),  # which shared head (None: none)
                    hs.integers(1, 12),  # own suffix length
                    hs.integers(1, 4),  # max_tokens
                    hs.sampled_from(["acme", "globex"]),
                    hs.integers(0, 6),  # arrival step
                    hs.one_of(hs.none(), hs.integers(0, 12)))  # cancel at step

    @settings(max_examples=12, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(hs.lists(one, min_size=1, max_size=7), hs.integers(0, 10**6))
    def check(specs, salt):
        eng.cache.delete()
        stp = Stepper(eng, share_prefix_min_tokens=CHUNK)
        rng = np.random.default_rng(salt)
        planned = []
        for i, (head, n, mx_t, tenant, at, cancel_at) in enumerate(specs):
            prompt = ((_head(head) if head is not None else [])
                      + [1000 + i] + [int(t) for t in rng.integers(3, 1000, size=n)])
            planned.append((at, cancel_at, prompt, mx_t, tenant))
        runs = {}
        step = 0
        while True:
            for i, (at, _, prompt, mx_t, tenant) in enumerate(planned):
                if at == step:
                    runs[i] = stp.submit(prompt, max_tokens=mx_t, tenant=tenant)
            for i, (_, cancel_at, *_rest) in enumerate(planned):
                if cancel_at == step and i in runs:
                    runs[i].cancel()
            busy = stp.step()
            step += 1
            if not busy and step > 7:
                break
            assert step < 2000, "the scheduler did not become idle"
        for i, (_, _cancel, prompt, mx_t, tenant) in enumerate(planned):
            res = runs[i].result
            assert res is not None
            if res.finish_reason == "cancelled":
                continue
            assert runs[i].tokens == reference(prompt, mx_t)
            # what was sent (and generated) before it in its tenant
            before = [p + runs[j].tokens for j, (at_j, _, p, _, t_j) in enumerate(planned)
                      if t_j == tenant and (at_j, j) < (planned[i][0], i)]
            longest = 0
            for p in before:
                n = min(len(p), len(prompt))
                same = next((k for k in range(n) if p[k] != prompt[k]), n)
                longest = max(longest, same)
            assert res.usage.cached_tokens <= longest

    check()


def test_no_wait_when_the_cache_already_holds_the_shared_prefix_for_it(tiny_llama_path,
                                                                       engine_factory):
    """Two agents' second turns arrive together: each one's first turn is cached (the
    shared head included), so neither waits for the other, even though the other has
    not started yet when it is looked at; they prefill their new tokens as one batch."""
    eng = engine_factory(tiny_llama_path)
    st = Stepper(eng, share_prefix_min_tokens=CHUNK)
    first = _prompts(n=2)
    for p in first:
        st.submit(p, max_tokens=3)
        st.run()
    assert st.ctx.counters.shared_prefix_waits == 0
    batches = st.ctx.counters.prefill_batches
    rng = np.random.default_rng(3)
    second = [p + [int(t) for t in rng.integers(3, 1000, size=20)] for p in first]
    runs = [st.submit(p, max_tokens=3) for p in second]
    st.run()
    assert st.ctx.counters.shared_prefix_waits == 0
    assert [r.result.usage.cached_tokens >= len(p) // BLOCK * BLOCK - BLOCK
            for r, p in zip(runs, first, strict=True)] == [True, True]
    assert st.ctx.counters.prefill_batches > batches
    assert st.ctx.counters.max_prefill_batch == 2


def test_a_failing_lookup_never_makes_a_request_wait(tiny_llama_path, engine_factory,
                                                     monkeypatch):
    prompts = _prompts(n=2)
    eng = engine_factory(tiny_llama_path)
    st = Stepper(eng, share_prefix_min_tokens=CHUNK)

    def broken(*a, **k):
        raise OSError("tier down")

    monkeypatch.setattr(eng.cache, "lookup", broken)
    runs, _, _ = _together(st, eng, prompts)
    assert st.ctx.counters.shared_prefix_waits == 0
    assert [r.result.finish_reason for r in runs] == ["length", "length"]
