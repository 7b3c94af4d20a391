"""Generation with the block cache: save points, usage counts, bad input, failures, interleaving."""

from __future__ import annotations

import numpy as np
import pytest
from stepper import Stepper

from promptcache.engine.api import (
    CacheMiss,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    TokenEvent,
)
from promptcache.errors import ContextLengthError, RequestError

BLOCK = 8


@pytest.fixture(scope="module")
def llama(engine_factory, tiny_llama_path):
    return engine_factory(tiny_llama_path)


def _toks(n, seed):
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 1000, size=n)]


def _req(tokens, max_tokens=6, **kw):
    sampling = SamplingParams(max_tokens=max_tokens, **{k: v for k, v in kw.items() if k in SamplingParams.__dataclass_fields__})
    rest = {k: v for k, v in kw.items() if k not in SamplingParams.__dataclass_fields__}
    return GenerationRequest(prompt_tokens=tuple(tokens), sampling=sampling, **rest)


def test_cancel_mid_prefill_keeps_completed_chunks(llama):
    prompt = _toks(40, 100)
    st = Stepper(llama)
    run = st.submit(prompt)
    assert st.step() is True  # lookup (a miss) + chunk [0, 16): 2 blocks stored
    assert run.req.usage.cached_tokens == 0
    assert st.step() is True  # chunk [16, 32): 2 more
    assert run.req.usage.saved_mid_prefill == 4
    run.cancel()
    assert st.step() is True
    res = run.result
    assert isinstance(res, GenerationResult) and res.finish_reason == "cancelled"
    assert res.tokens == [] and res.usage.saved_end_prefill == 0
    assert st.step() is False  # idle
    # the next identical request resumes at the last completed chunk
    again = llama.submit(_req(prompt, request_id="cancel-2")).result()
    assert again.finish_reason == "length"
    assert again.usage.cached_tokens == 32
    assert again.usage.cached_by_tier == {"ram": 32}
    assert again.usage.saved_mid_prefill == 0
    assert again.usage.saved_end_prefill == 1  # [32, 40)
    ref = llama.submit(_req(prompt, use_cache=False)).result()
    assert again.tokens == ref.tokens


def test_turn_two_hits_prompt_plus_output(llama):
    prompt = _toks(20, 200)
    t1 = llama.generate(prompt, max_tokens=6)
    assert t1.finish_reason == "length" and len(t1.tokens) == 6
    u = t1.usage
    assert (u.prompt_tokens, u.cached_tokens, u.completion_tokens) == (20, 0, 6)
    assert (u.saved_mid_prefill, u.saved_end_prefill) == (1 * 2, 1)  # [0,8),[8,16) then [16,20)
    # end of generation: prompt + output[:-1] = 25 tokens -> [16, 24) + partial [24, 25)
    assert u.saved_end_generation == 2
    turn2 = prompt + t1.tokens + _toks(7, 201)
    t2 = llama.generate(turn2, max_tokens=4)
    assert t2.usage.cached_tokens == 25
    assert t2.usage.prompt_tokens == 33 and t2.usage.prefilled_tokens == 8
    ref = llama.generate(turn2, max_tokens=4, use_cache=False)
    assert t2.tokens == ref.tokens
    assert ref.usage.cached_tokens == 0 and ref.usage.saved_end_prefill == 0


def test_exact_hit_reruns_last_token(llama):
    prompt = _toks(24, 300)
    first = llama.generate(prompt, max_tokens=3)
    second = llama.generate(prompt, max_tokens=3)
    assert second.usage.cached_tokens == 23
    assert second.tokens == first.tokens
    assert second.usage.saved_end_prefill == 0 and second.usage.saved_mid_prefill == 0


def test_streaming_events_and_text(llama):
    prompt = _toks(12, 400)
    h = llama.submit(_req(prompt, max_tokens=5, request_id="stream"))
    evs = list(h.events())
    assert [type(e).__name__ for e in evs] == ["TokenEvent"] * 5 + ["GenerationResult"]
    res = evs[-1]
    assert [e.token_id for e in evs[:-1]] == res.tokens
    assert "".join(e.text for e in evs[:-1]) == res.text == llama.tokenizer.decode(res.tokens)
    assert h.result() is res
    assert res.ttft_s > 0 and res.prefill_s > 0 and res.lookup_s > 0


def test_stop_strings_and_stop_ids(llama):
    prompt = _toks(10, 500)
    ref = llama.generate(prompt, max_tokens=8, use_cache=False)
    text = ref.text
    assert len(text) > 4
    stop = text[2:4]
    res = llama.generate(prompt, max_tokens=8, stop=[stop], use_cache=False)
    assert res.finish_reason == "stop"
    assert res.text == text[: text.find(stop)]
    # a stop token id ends the generation after that token
    res = llama.generate(prompt, max_tokens=8, stop_token_ids=[ref.tokens[3]], use_cache=False)
    assert res.finish_reason == "stop"
    assert res.tokens == ref.tokens[: ref.tokens.index(ref.tokens[3]) + 1]


def test_seeded_sampling_is_reproducible(llama):
    prompt = _toks(10, 600)
    a = llama.generate(prompt, max_tokens=8, temperature=1.0, top_p=0.9, seed=7, use_cache=False)
    b = llama.generate(prompt, max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    c = llama.generate(prompt, max_tokens=8, temperature=1.0, top_p=0.9, seed=8, use_cache=False)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_bad_input_raises_and_leaves_cache_unchanged(llama):
    before = llama.cache.stats().to_dict()
    ctx = llama.context_length
    with pytest.raises(ContextLengthError, match="exceeds the model's context length"):
        llama.submit(_req(_toks(ctx - 4, 1), max_tokens=5))
    with pytest.raises(ValueError, match="max_tokens must be > 0"):
        llama.generate(_toks(5, 1), max_tokens=0)
    with pytest.raises(ValueError, match="stop strings must be non-empty strings"):
        llama.generate(_toks(5, 1), stop=[3])
    with pytest.raises(RequestError, match="unknown sampling parameters"):
        llama.generate(_toks(5, 1), stop_sequences=["x"])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llama.generate([5, 99999])
    with pytest.raises(RequestError, match="must not be empty"):
        llama.generate([])
    with pytest.raises(RequestError, match="messages"):
        llama.render_chat([])
    assert isinstance(ContextLengthError("x"), ValueError)
    assert llama.cache.stats().to_dict() == before


class _BrokenCache:
    def acquire(self, *a, **k):
        raise OSError("disk on fire")

    def store(self, *a, **k):
        raise RuntimeError("cannot store")

    def release(self, hit):  # pragma: no cover - never reached
        pass


def test_cache_failure_falls_back_to_full_prefill(llama):
    from promptcache.engine.engine import Engine

    eng = Engine(llama.model, llama.tokenizer, model_id="x", fingerprint="fp",
                 context_length=llama.context_length, vocab_size=1024,
                 engine_config=llama.engine_config, cache_config=llama.cache_config,
                 cache=_BrokenCache())
    try:
        prompt = _toks(20, 700)
        res = eng.generate(prompt, max_tokens=4)
        ref = llama.generate(prompt, max_tokens=4, use_cache=False)
        assert res.finish_reason == "length" and res.tokens == ref.tokens
        assert res.usage.cached_tokens == 0 and res.usage.saved_end_prefill == 0
        c = eng.counters.to_dict()
        assert c["cache_errors"] == 1 and c["store_errors"] == 3  # mid, end_prefill, end_generation
        assert c["errors"] == 0
    finally:
        eng.close()


def test_interleaved_requests_equal_sequential(llama):
    p1, p2 = _toks(45, 800), _toks(30, 801)
    seq1 = llama.generate(p1, max_tokens=6, temperature=0.9, seed=1, use_cache=False)
    seq2 = llama.generate(p2, max_tokens=6, temperature=0.9, seed=2, use_cache=False)
    h1 = llama.submit(_req(p1, max_tokens=6, temperature=0.9, seed=1, use_cache=False))
    h2 = llama.submit(_req(p2, max_tokens=6, temperature=0.9, seed=2, use_cache=False))
    r1, r2 = h1.result(timeout=60), h2.result(timeout=60)
    assert r1.tokens == seq1.tokens and r2.tokens == seq2.tokens


def test_prefill_and_decode_interleave_one_chunk_per_step(llama):
    """A long prompt advances one chunk per step while another request decodes in
    the batch every step; both equal their solo runs."""
    p1, p2 = _toks(64, 900), _toks(12, 901)
    solo = [llama.generate(p, max_tokens=5, use_cache=False).tokens for p in (p1, p2)]
    st = Stepper(llama)
    short = st.submit(p2, max_tokens=5, use_cache=False)
    st.step()  # p2 prefilled in one chunk: first token out, joins the batch
    assert len(short.tokens) == 1
    long = st.submit(p1, max_tokens=5, use_cache=False)
    for chunk in range(4):  # 64 tokens = 4 chunks of 16
        st.step()
        assert long.req.pos == 16 * (chunk + 1)
        # the short request's decode never waits for the long prefill
        assert len(short.tokens) == min(5, 1 + chunk)  # pipelined: reported a step later
    st.run()
    assert long.result.tokens == solo[0] and short.result.tokens == solo[1]
    assert all(isinstance(e, TokenEvent) for e in long.events[:-1])


async def _collect(handle):
    return [ev async for ev in handle.aevents()]


def test_aevents(llama):
    import asyncio

    h = llama.submit(_req(_toks(10, 1000), max_tokens=3))
    evs = asyncio.run(_collect(h))
    assert isinstance(evs[-1], GenerationResult) and len(evs) == 4


def test_cancel_during_decode_through_handle(llama):
    prompt = _toks(20, 1100)
    h = llama.submit(_req(prompt, max_tokens=400, stop_token_ids=()))
    got = []
    for ev in h.events():
        got.append(ev)
        if len(got) == 3:
            h.cancel()
    res = got[-1]
    assert res.finish_reason == "cancelled"
    assert 3 <= len(res.tokens) < 400
    # the decoded tokens whose KV exists were saved: the continuation hits them
    n = len(prompt) + len(res.tokens) - 1
    assert res.usage.saved_end_generation == (n // BLOCK) - (len(prompt) // BLOCK) + (1 if n % BLOCK else 0)
    nxt = llama.generate(prompt + res.tokens + [5], max_tokens=1)
    assert nxt.usage.cached_tokens == n


def test_miss_is_data_and_names_position_and_message(llama):
    m = CacheMiss.of("diverged", 17, 16, 30, (0, 7, 14, 25))
    assert m.message_index == 2
    assert m.describe() == (
        "diverged: first uncached token at position 17 (chat message 2); state restorable at 16"
    )
    assert CacheMiss.of("cold", 0, 0, 5).describe() == "cold: first uncached token at position 0"
    msgs = [{"role": "user", "content": "a question about rivers"}]
    first = llama.generate(msgs, max_tokens=2)
    assert first.miss is not None and first.miss.cause in ("cold", "diverged")
    assert (first.miss.position, first.miss.restorable, first.miss.message_index) == (0, 0, 0)
    assert first.miss.num_tokens == first.usage.prompt_tokens
    assert first.miss_reason == first.miss.describe()
    assert first.miss_reason.endswith(": first uncached token at position 0 (chat message 0)")


def test_aevents_many_concurrent_streams(llama):
    import asyncio

    prompts = [_toks(12, 1200 + i) for i in range(12)]

    async def main():
        handles = [llama.submit(_req(p, max_tokens=4, use_cache=False)) for p in prompts]
        return await asyncio.gather(*(_collect(h) for h in handles))

    results = asyncio.run(main())
    for p, evs in zip(prompts, results, strict=True):
        assert [type(e).__name__ for e in evs] == ["TokenEvent"] * 4 + ["GenerationResult"]
        assert evs[-1].tokens == llama.generate(p, max_tokens=4, use_cache=False).tokens
