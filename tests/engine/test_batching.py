"""Batched decode equals each request run alone, for every tiny model kind.

Requests are driven through a Stepper (the scheduler on the test thread): a batch
of B prompts is submitted at once, they prefill one chunk per step and join the
decode batch at different steps, and leave it at different steps (max_tokens
varies), so rows join and leave a live batch at any step. Greedy tokens must be
identical; logits agree within TOL (float32: a batched matmul sums in another order
than a batch of one: observed max |delta| ~5e-5 on gemma3, ~3e-6 on llama/hybrid).
"""

from __future__ import annotations

import numpy as np
import pytest
from stepper import Stepper

from promptcache.engine import mlx_compat
from promptcache.engine.formats import constrained

N_PROMPTS = 20
TOL = 1e-4


def _prompts(seed, n=N_PROMPTS, lo=5, hi=60, first=700):
    rng = np.random.default_rng(seed)
    return [[first + i] + [int(t) for t in rng.integers(3, 1000, size=int(rng.integers(lo, hi)) - 1)]
            for i in range(n)]


def _max_tokens(i):
    # long enough that 8 rows overlap while the later ones still prefill (a chunk per
    # step), varied so that rows leave the batch at different steps
    return 18 + i % 7


def _alone(eng, prompts, **kw):
    st = Stepper(eng)
    out = []
    for i, p in enumerate(prompts):
        run = st.submit(p, max_tokens=_max_tokens(i), use_cache=kw.get("use_cache", False),
                        **{k: v for k, v in kw.items() if k != "use_cache"})
        st.run()
        out.append((run.result, eng.recorder.by_request.pop(run.request.request_id)))
    return out


def _batched(eng, prompts, batch, **kw):
    st = Stepper(eng)
    out = []
    for g in range(0, len(prompts), batch):
        runs = [st.submit(p, max_tokens=_max_tokens(g + j), use_cache=kw.get("use_cache", False),
                          **{k: v for k, v in kw.items() if k != "use_cache"})
                for j, p in enumerate(prompts[g : g + batch])]
        st.run()
        out += [(r.result, eng.recorder.by_request.pop(r.request.request_id)) for r in runs]
    return out, st


def _compare(a, b):
    worst = 0.0
    for (ra, la), (rb, lb) in zip(a, b, strict=True):
        assert ra.finish_reason in ("length", "stop"), ra.error
        assert ra.tokens == rb.tokens
        assert len(la) == len(lb) == len(ra.tokens)
        worst = max(worst, *(float(np.max(np.abs(x - y))) for x, y in zip(la, lb, strict=True)))
    return worst


@pytest.fixture(scope="module", params=["llama", "gemma3_text", "hybrid"])
def kind_engine(request, tiny_model_path, engine_factory):
    return request.param, engine_factory(tiny_model_path(request.param))


def test_batched_greedy_equals_alone_at_batch_sizes_1_2_4_8(kind_engine):
    kind, eng = kind_engine
    prompts = _prompts(1)
    alone = _alone(eng, prompts)
    worst = 0.0
    for batch in (1, 2, 4, 8):
        got, st = _batched(eng, prompts, batch)
        worst = max(worst, _compare(got, alone))
        assert st.ctx.counters.max_batch == batch
        assert st.ctx.counters.active_kv_bytes == 0  # nothing held once idle
    print(f"\n[{kind}] batched vs alone: max |delta logits| = {worst:.2e}")
    assert worst <= TOL


def test_cached_equals_uncached_under_batching(kind_engine):
    kind, eng = kind_engine
    prompts = _prompts(2, first=760)
    first, _ = _batched(eng, prompts, 8, use_cache=True)  # stores prompt + output
    rng = np.random.default_rng(3)
    turn2 = [p + r.tokens + [int(t) for t in rng.integers(3, 1000, size=int(rng.integers(1, 20)))]
             for p, (r, _) in zip(prompts, first, strict=True)]
    cached, _ = _batched(eng, turn2, 8, use_cache=True)
    plain, _ = _batched(eng, turn2, 8, use_cache=False)
    assert _compare(cached, plain) <= TOL
    for p, (r1, _), (r2, _) in zip(prompts, first, cached, strict=True):
        if kind == "hybrid":  # restorable only at a stored snapshot
            assert r2.usage.cached_tokens > 0
        else:  # prompt + output[:-1]
            assert r2.usage.cached_tokens == len(p) + len(r1.tokens) - 1
        assert r2.miss is not None and r2.miss.position >= r2.usage.cached_tokens


def test_seeded_sampling_in_a_batch_equals_alone(tiny_llama_path, engine_factory):
    eng = engine_factory(tiny_llama_path)
    prompts = _prompts(4, n=6, first=800)
    kw = {"temperature": 0.9, "top_p": 0.95, "seed": 11}
    alone = _alone(eng, prompts, **kw)
    got, _ = _batched(eng, prompts, 6, **kw)
    assert [r.tokens for r, _ in got] == [r.tokens for r, _ in alone]
    other, _ = _batched(eng, prompts, 6, temperature=0.9, top_p=0.95, seed=12)
    assert [r.tokens for r, _ in other] != [r.tokens for r, _ in alone]


def test_stop_strings_and_stop_ids_in_a_batch(tiny_llama_path, engine_factory):
    eng = engine_factory(tiny_llama_path)
    prompts = _prompts(5, n=4, first=820)
    st = Stepper(eng)
    refs = [st.submit(p, max_tokens=10, use_cache=False) for p in prompts]
    st.run()
    for r in refs:
        eng.recorder.by_request.pop(r.request.request_id, None)
    stop_text = refs[0].result.text[2:4]
    stop_id = refs[1].result.tokens[3]
    runs = [st.submit(prompts[0], max_tokens=10, use_cache=False, stop=(stop_text,)),
            st.submit(prompts[1], max_tokens=10, use_cache=False, stop_token_ids=(stop_id,)),
            st.submit(prompts[2], max_tokens=10, use_cache=False)]
    st.run()
    a, b, c = (r.result for r in runs)
    assert a.finish_reason == "stop" and a.stop_sequence == stop_text
    assert a.text == refs[0].result.text[: refs[0].result.text.find(stop_text)]
    assert b.finish_reason == "stop" and b.stop_sequence is None
    assert b.tokens == refs[1].result.tokens[: refs[1].result.tokens.index(stop_id) + 1]
    assert c.tokens == refs[2].result.tokens


def test_logprobs_and_top_k(tiny_llama_path, engine_factory):
    eng = engine_factory(tiny_llama_path)
    prompt = _prompts(6, n=1, first=840)[0]
    st = Stepper(eng)
    plain = st.submit(prompt, max_tokens=5, use_cache=False)
    withlp = st.submit(prompt, max_tokens=5, use_cache=False, logprobs=3)
    st.run()
    logits = eng.recorder.by_request.pop(withlp.request.request_id)
    eng.recorder.by_request.pop(plain.request.request_id)
    assert withlp.result.tokens == plain.result.tokens
    events = [e for e in withlp.events if hasattr(e, "token_id")]
    assert all(e.logprob is None for e in plain.events if hasattr(e, "token_id"))
    for ev, lg in zip(events, logits, strict=True):
        lp = lg - np.log(np.sum(np.exp(lg - lg.max()))) - lg.max()
        assert len(ev.top_logprobs) == 3
        assert ev.top_logprobs[0][0] == ev.token_id  # greedy: the most likely token
        assert ev.logprob == pytest.approx(float(lp[ev.token_id]), abs=1e-4)
        top = np.argsort(-lp)[:3]
        assert [i for i, _ in ev.top_logprobs] == [int(i) for i in top]
    zero = st.submit(prompt, max_tokens=2, use_cache=False, logprobs=0)
    # top_k=1 sampling at any temperature is greedy
    topk = st.submit(prompt, max_tokens=5, use_cache=False, temperature=1.5, top_k=1, seed=3)
    st.run()
    eng.recorder.by_request.clear()
    assert all(e.top_logprobs == () and e.logprob is not None
               for e in zero.events if hasattr(e, "token_id"))
    assert topk.result.tokens == plain.result.tokens


def test_prefill_only_stores_the_prompt_and_generates_nothing(tiny_llama_path, engine_factory):
    eng = engine_factory(tiny_llama_path)
    prompt = _prompts(7, n=1, lo=40, hi=41, first=860)[0]
    st = Stepper(eng)
    run = st.submit(prompt, max_tokens=50, prefill_only=True, background=True)
    st.run()
    res = run.result
    assert res.finish_reason == "prefilled" and res.tokens == [] and run.tokens == []
    assert (res.usage.saved_mid_prefill, res.usage.saved_end_prefill) == (4, 1)  # 40 = 5 blocks
    nxt = st.submit(prompt + [5, 6], max_tokens=3)
    st.run()
    eng.recorder.by_request.clear()
    assert nxt.result.usage.cached_tokens == 40


def test_a_background_job_delays_an_interactive_request_by_at_most_one_chunk(
        tiny_llama_path, engine_factory):
    """Counted in scheduler steps: every step runs at most one prefill chunk."""
    eng = engine_factory(tiny_llama_path)
    st = Stepper(eng)
    bg = st.submit(_prompts(8, n=1, lo=160, hi=161, first=880)[0], prefill_only=True,
                   background=True, use_cache=False)
    for i in range(3):
        st.step()
        assert bg.req.pos == 16 * (i + 1)
    ia = st.submit(_prompts(9, n=1, lo=40, hi=41, first=881)[0], max_tokens=4, use_cache=False)
    # the very next step prefills the interactive request, not the background one
    st.step()
    assert ia.req.pos == 16 and bg.req.pos == 48
    assert st.scheduler.last_prefilled is ia.req
    st.step()
    st.step()  # 40 tokens = 3 chunks: the first token is out
    assert ia.req.pos == 40 and len(ia.tokens) == 1 and bg.req.pos == 48
    st.step()  # the interactive request decodes in the batch; the background resumes
    assert bg.req.pos == 64
    st.run()
    eng.recorder.by_request.clear()
    assert bg.result.finish_reason == "prefilled" and ia.result.finish_reason == "length"


def test_cancel_a_row_mid_batch(tiny_llama_path, engine_factory):
    eng = engine_factory(tiny_llama_path)
    prompts = _prompts(10, n=3, first=900)
    alone = _alone(eng, prompts)
    st = Stepper(eng)
    runs = [st.submit(p, max_tokens=_max_tokens(i) + 20, use_cache=False)
            for i, p in enumerate(prompts)]
    while len(runs[1].tokens) < 3:
        st.step()
    runs[1].cancel()
    st.run()
    eng.recorder.by_request.clear()
    assert runs[1].result.finish_reason == "cancelled"
    assert 0 < len(runs[1].result.tokens) < _max_tokens(1) + 20
    for i in (0, 2):  # the other rows are not disturbed
        n = len(alone[i][0].tokens)
        assert runs[i].result.tokens[:n] == alone[i][0].tokens


def test_rows_beyond_max_batch_size_wait_for_a_free_row(tiny_llama_path, engine_factory):
    eng = engine_factory(tiny_llama_path)
    prompts = _prompts(11, n=5, first=920)
    alone = _alone(eng, prompts)
    st = Stepper(eng, max_batch_size=2)
    runs = [st.submit(p, max_tokens=_max_tokens(i)) for i, p in enumerate(prompts)]
    st.run()
    eng.recorder.by_request.clear()
    assert st.ctx.counters.max_batch == 2
    assert [r.result.tokens for r in runs] == [r.tokens for r, _ in alone]


def test_caches_that_cannot_batch_decode_alone(kind_engine, monkeypatch):
    """The per-request path (quantized KV, windows that keep tokens) gives the same."""
    kind, eng = kind_engine
    prompts = _prompts(12, n=4, first=940)
    alone = _alone(eng, prompts)
    monkeypatch.setattr(mlx_compat, "can_batch", lambda caches: False)
    got, st = _batched(eng, prompts, 4)
    assert _compare(got, alone) <= TOL
    assert st.ctx.counters.solo_steps > 0 and st.ctx.counters.decode_steps == 0


def test_a_constraint_processor_shapes_every_row(tiny_llama_path, engine_factory, monkeypatch):
    eng = engine_factory(tiny_llama_path)
    prompts = _prompts(13, n=3, first=960)
    free = _alone(eng, prompts)
    banned = {t for r, _ in free for t in r.tokens}
    seen: list[int] = []

    def factory(constraint, tokenizer, vocab_size):
        import mlx.core as mx

        mask = np.zeros(vocab_size, dtype=np.float32)
        mask[sorted(banned)] = -np.inf
        bias = mx.array(mask)

        def processor(tokens, logits):
            seen.append(int(tokens.shape[0]))
            return logits + bias

        return processor

    monkeypatch.setattr(constrained, "logits_processor", factory)
    from promptcache.engine.api import Constraint, GenerationRequest, SamplingParams

    handles = [eng.submit(GenerationRequest(
        prompt_tokens=tuple(p), sampling=SamplingParams(max_tokens=4), use_cache=False,
        constraint=Constraint("regex", "[a-z]+"))) for p in prompts]
    results = [h.result(timeout=60) for h in handles]
    eng.recorder.by_request.clear()
    for r in results:
        assert r.finish_reason == "length" and not (set(r.tokens) & banned)
    # the processor saw prompt + every token generated so far, at every step
    assert sorted(seen) == sorted(len(p) + k for p in prompts for k in range(4))
