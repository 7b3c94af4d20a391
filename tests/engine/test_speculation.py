"""Speculative decoding (engine/speculation/speculator.py): greedy output with speculation equals
decoding one token at a time, whatever the drafts are (right, wrong, half right, the
request's own history), stop strings and max_tokens inside an accepted draft stop
exactly where they would, and what is saved restores the same next turn."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import counts, make_engine

from promptcache.engine.api import Constraint, GenerationRequest, SamplingParams
from promptcache.engine.speculation.speculator import Speculator

N_PROMPTS = 3


def prompt(seed: int, n: int = 40) -> tuple[int, ...]:
    rng = np.random.default_rng(seed)
    body = [int(t) for t in rng.integers(3, 1000, size=n)]
    return tuple(body + body[:12])  # a repeat: the own-history index finds matches


def run(eng: Any, toks: tuple[int, ...], max_tokens: int = 40, **sp: Any) -> Any:
    return eng.submit(GenerationRequest(prompt_tokens=toks, sampling=SamplingParams(
        max_tokens=max_tokens, **sp))).result(timeout=300)


@pytest.fixture(scope="module")
def reference(tiny_llama_path: Any) -> dict[tuple[int, ...], list[int]]:
    eng = make_engine(tiny_llama_path, use_cache=False)
    try:
        return {prompt(s): run(eng, prompt(s)).tokens for s in range(N_PROMPTS)}
    finally:
        eng.close()


def source_of(kind: str, ref: dict[tuple[int, ...], list[int]]) -> Any:
    rng = np.random.default_rng(7)

    def source(r: Any, k: int) -> list[int]:
        truth = ref[tuple(r.req.prompt_tokens)][len(r.output):len(r.output) + k]
        wrong = [(t + 1 + int(rng.integers(0, 5))) % 1000 for t in truth]
        if kind == "right":
            return truth
        if kind == "wrong":
            return wrong
        half = len(truth) // 2
        return truth[:half] + wrong[half:]

    return source


@pytest.mark.parametrize("kind", ["right", "wrong", "half", "history"])
def test_greedy_output_equals_decoding_one_token_at_a_time(tiny_llama_path: Any,
                                                           reference: Any, kind: str) -> None:
    eng = make_engine(tiny_llama_path, use_cache=False, speculation="suffix",
                      spec_max_draft=8, spec_min_match=2)
    try:
        eng.recorder = None
        eng._ctx.logits_hook = None
        spec = eng._ctx.speculator
        assert isinstance(spec, Speculator)
        if kind != "history":
            spec.source = source_of(kind, reference)
        for toks, want in reference.items():
            got = run(eng, toks)
            assert got.tokens == want, kind
        c = counts(eng._ctx)
        assert c.spec_verifies > 0
        if kind == "right":
            # every verify forward accepted its whole draft: ~k+1 tokens per forward
            assert c.spec_accepted == c.spec_drafted > 0
            assert c.decode_steps < N_PROMPTS * 40 // 2
        if kind == "wrong":
            assert c.spec_accepted == 0
        if kind == "half":
            assert 0 < c.spec_accepted < c.spec_drafted
    finally:
        eng.close()


def test_stops_inside_an_accepted_draft(tiny_llama_path: Any, reference: Any) -> None:
    plain = make_engine(tiny_llama_path, use_cache=False)
    spec_eng = make_engine(tiny_llama_path, use_cache=False, speculation="suffix")
    try:
        spec_eng._ctx.logits_hook = None
        spec_eng._ctx.speculator.source = source_of("right", reference)
        toks = prompt(0)
        full = run(plain, toks)
        stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
        for sp in ({"max_tokens": 13}, {"max_tokens": 40, "stop": (stop,)} if stop.strip()
                   else {"max_tokens": 21}):
            want = run(plain, toks, **sp)
            got = run(spec_eng, toks, **sp)
            assert (got.tokens, got.text, got.finish_reason) == \
                (want.tokens, want.text, want.finish_reason)
        assert counts(spec_eng._ctx).spec_accepted > 0
    finally:
        plain.close()
        spec_eng.close()


def test_what_speculation_saves_restores_the_same_next_turn(tiny_llama_path: Any,
                                                            reference: Any) -> None:
    plain = make_engine(tiny_llama_path)
    spec_eng = make_engine(tiny_llama_path, speculation="suffix")
    try:
        for e in (plain, spec_eng):
            e._ctx.logits_hook = None
        spec_eng._ctx.speculator.source = source_of("right", reference)
        toks = prompt(1)
        first = [run(e, toks) for e in (plain, spec_eng)]
        assert first[0].tokens == first[1].tokens
        nxt = toks + tuple(first[0].tokens) + tuple(range(5, 25))
        spec_eng._ctx.speculator.source = None  # own history from here
        second = [run(e, nxt, max_tokens=12) for e in (plain, spec_eng)]
        assert second[0].tokens == second[1].tokens
        assert second[0].usage.cached_tokens == second[1].usage.cached_tokens > len(toks)
        assert spec_eng.counters.store_errors == 0
    finally:
        plain.close()
        spec_eng.close()


DIGITS = Constraint("regex", "[0-9]{1,200}")


def test_constrained_drafts_the_grammar_rejects_are_never_verified(tiny_llama_path: Any
                                                                   ) -> None:
    """Constrained rows speculate with grammar-checked drafts (more in
    test_speculation_constrained.py): a draft the grammar rejects is cut to nothing."""
    eng = make_engine(tiny_llama_path, use_cache=False, speculation="suffix")
    try:
        eng._ctx.logits_hook = None
        bad = eng._ctx.tokenizer.encode("Q", add_special_tokens=False)[-1]  # not a digit
        eng._ctx.speculator.source = lambda r, k: [bad] * k
        eng.submit(GenerationRequest(prompt_tokens=prompt(2), sampling=SamplingParams(
            max_tokens=8), constraint=DIGITS)).result(timeout=300)  # a constraint
        assert counts(eng._ctx).spec_verifies == 0 and counts(eng._ctx).spec_grammar_cut > 0
    finally:
        eng.close()


@pytest.mark.parametrize("kind", ["right", "half"])
def test_logprobs_equal_decoding_one_token_at_a_time(tiny_llama_path: Any, reference: Any,
                                                     kind: str) -> None:
    """Each emitted token's log-probability and top alternatives come from the verify
    forward's logits at its position: the same ids, values within float tolerance."""
    def events(eng: Any, toks: tuple[int, ...]) -> list[Any]:
        h = eng.submit(GenerationRequest(prompt_tokens=toks, sampling=SamplingParams(
            max_tokens=40, logprobs=3)))
        return [ev for ev in h.events() if hasattr(ev, "logprob")]

    plain = make_engine(tiny_llama_path, use_cache=False)
    spec_eng = make_engine(tiny_llama_path, use_cache=False, speculation="suffix")
    try:
        spec_eng._ctx.logits_hook = None
        spec_eng._ctx.speculator.source = source_of(kind, reference)
        for toks in reference:
            want, got = events(plain, toks), events(spec_eng, toks)
            assert [e.token_id for e in got] == [e.token_id for e in want]
            assert len(got) == 40
            for g, w in zip(got, want, strict=True):
                assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
                assert [t for t, _ in g.top_logprobs] == [t for t, _ in w.top_logprobs]
                assert [v for _, v in g.top_logprobs] == pytest.approx(
                    [v for _, v in w.top_logprobs], abs=1e-4)
        assert counts(spec_eng._ctx).spec_accepted > 0
    finally:
        plain.close()
        spec_eng.close()


def test_config_is_checked() -> None:
    from promptcache.serving_config import EngineConfig

    for kw in ({"speculation": "ngram"}, {"spec_max_draft": 0}, {"spec_min_match": 0},
               {"spec_pool_tokens": -1}, {"spec_pool_prompt_tokens": -1}):
        with pytest.raises(ValueError):
            EngineConfig(restore_plan="load", **kw)


@pytest.mark.parametrize("kind", ["right", "wrong", "half"])
def test_sampled_output_equals_decoding_one_token_at_a_time(tiny_llama_path: Any,
                                                            kind: str) -> None:
    """temperature > 0 with a seed: each position is sampled in order with the request's
    key; the same seed gives the same tokens with or without speculation."""
    sp = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    plain = make_engine(tiny_llama_path, use_cache=False)
    try:
        ref = {prompt(s): run(plain, prompt(s), **sp).tokens for s in range(N_PROMPTS)}
    finally:
        plain.close()
    eng = make_engine(tiny_llama_path, use_cache=False, speculation="suffix")
    try:
        eng._ctx.logits_hook = None
        eng._ctx.speculator.source = source_of(kind, ref)
        for toks, want in ref.items():
            assert run(eng, toks, **sp).tokens == want, kind
        c = counts(eng._ctx)
        assert c.spec_verifies > 0
        if kind == "right":
            assert c.spec_accepted == c.spec_drafted
        elif kind == "wrong":
            assert c.spec_accepted == 0
        else:
            assert 0 < c.spec_accepted < c.spec_drafted
    finally:
        eng.close()


def run_many(eng: Any, prompts: list[tuple[int, ...]], max_tokens: int = 40,
             **sp: Any) -> list[Any]:
    handles = [eng.submit(GenerationRequest(prompt_tokens=p, sampling=SamplingParams(
        max_tokens=max_tokens, **sp))) for p in prompts]
    return [h.result(timeout=300) for h in handles]


@pytest.mark.parametrize("rows", [2, 4, 8])
def test_batched_rows_with_mixed_drafts_equal_decoding_alone(tiny_llama_path: Any,
                                                             rows: int) -> None:
    """Rows of one verify forward each get right, wrong or half-right drafts of
    different lengths (padding, per-row rejected tails); every row's tokens equal
    decoding it alone without speculation."""
    prompts = [prompt(100 + i, n=30 + 3 * i) for i in range(rows)]
    plain = make_engine(tiny_llama_path, use_cache=False)
    try:
        ref = {p: run(plain, p, max_tokens=24).tokens for p in prompts}
    finally:
        plain.close()
    kinds = ["right", "wrong", "half"]
    sources = {p: source_of(kinds[i % 3], ref) for i, p in enumerate(prompts)}
    eng = make_engine(tiny_llama_path, use_cache=False, speculation="suffix",
                      spec_max_draft=6)
    try:
        eng._ctx.logits_hook = None
        eng._ctx.speculator.source = lambda r, k: sources[tuple(r.req.prompt_tokens)](r, k)
        got = run_many(eng, prompts, max_tokens=24)
        assert [g.tokens for g in got] == [ref[p] for p in prompts]
        c = counts(eng._ctx)
        assert c.spec_verifies > 0 and c.max_batch >= 2
        assert c.decode_rows > c.decode_steps  # verify forwards ran over several rows
        assert 0 < c.spec_accepted < c.spec_drafted
    finally:
        eng.close()


def test_batched_speculation_saves_what_restores_the_same_next_turn(tiny_llama_path: Any
                                                                   ) -> None:
    """Four rows verify together with right, wrong and half-right drafts, so their
    repairs move rows' first positions into rejected tails (``RowMoves``); what each
    row saves when it ends is read back in temporal order: every next turn restores
    as much and decodes the same tokens as after decoding without speculation."""
    prompts = [prompt(300 + i, n=40 + 5 * i) for i in range(4)]
    ref_eng = make_engine(tiny_llama_path, use_cache=False)
    try:
        ref = {p: run(ref_eng, p, max_tokens=32).tokens for p in prompts}
    finally:
        ref_eng.close()
    kinds = ["right", "wrong", "half", "half"]
    sources = {p: source_of(kinds[i], ref) for i, p in enumerate(prompts)}
    plain = make_engine(tiny_llama_path)
    spec_eng = make_engine(tiny_llama_path, speculation="suffix", spec_max_draft=6)
    try:
        for e in (plain, spec_eng):
            e._ctx.logits_hook = None
        spec_eng._ctx.speculator.source = lambda r, k: sources[tuple(r.req.prompt_tokens)](r, k)
        first = [run_many(e, prompts, max_tokens=32) for e in (plain, spec_eng)]
        assert [g.tokens for g in first[1]] == [g.tokens for g in first[0]] \
            == [ref[p] for p in prompts]
        c = counts(spec_eng._ctx)
        assert c.spec_multirow > 0 and 0 < c.spec_accepted < c.spec_drafted
        spec_eng._ctx.speculator.source = None
        nxt = [p + tuple(g.tokens) + tuple(range(5, 15)) for p, g in zip(prompts, first[0],
                                                                        strict=True)]
        second = [[run(e, q, max_tokens=12) for q in nxt] for e in (plain, spec_eng)]
        assert [g.tokens for g in second[1]] == [g.tokens for g in second[0]]
        assert [g.usage.cached_tokens for g in second[1]] \
            == [g.usage.cached_tokens for g in second[0]]
        assert all(g.usage.cached_tokens > len(p) for g, p in zip(second[1], prompts,
                                                                 strict=True))
        assert spec_eng.counters.store_errors == 0
    finally:
        plain.close()
        spec_eng.close()


def test_a_batch_mixing_constrained_and_free_rows_decodes_as_before(tiny_llama_path: Any
                                                                    ) -> None:
    prompts = [prompt(200 + i) for i in range(3)]
    plain = make_engine(tiny_llama_path, use_cache=False)
    try:
        ref = [plain.submit(GenerationRequest(prompt_tokens=p, sampling=SamplingParams(
            max_tokens=16), constraint=DIGITS if i == 0 else None)).result(timeout=300).tokens
            for i, p in enumerate(prompts)]
    finally:
        plain.close()
    eng = make_engine(tiny_llama_path, use_cache=False, speculation="suffix")
    try:
        eng._ctx.logits_hook = None
        eng._ctx.speculator.source = lambda r, k: [5] * k
        handles = [eng.submit(GenerationRequest(prompt_tokens=p, sampling=SamplingParams(
            max_tokens=16), constraint=DIGITS if i == 0 else None))
            for i, p in enumerate(prompts)]
        assert [h.result(timeout=300).tokens for h in handles] == ref
    finally:
        eng.close()


def test_the_tenant_pool_drafts_for_its_own_tenant_only(tiny_llama_path: Any) -> None:
    """A's finished reply is the perfect draft for an identical prompt: A's second request
    gets pool drafts (accepted) and the same tokens; tenant B never drafts from A's."""
    toks = tuple(int(t) for t in np.random.default_rng(300).integers(3, 1000, size=40))
    plain = make_engine(tiny_llama_path, use_cache=False)
    try:
        want = run(plain, toks).tokens
    finally:
        plain.close()
    eng = make_engine(tiny_llama_path, use_cache=False, speculation="suffix",
                      spec_pool_prompt_tokens=16)
    try:
        eng._ctx.logits_hook = None
        c = counts(eng._ctx)

        def go(tenant: str) -> Any:
            return eng.submit(GenerationRequest(prompt_tokens=toks, tenant=tenant,
                                                sampling=SamplingParams(max_tokens=40))
                              ).result(timeout=300)

        assert go("a").tokens == want
        assert c.spec_pool_drafted == 0
        assert eng.engine_stats()["spec_pool_tokens"] == 16 + len(want)
        b = go("b")
        assert b.tokens == want
        assert c.spec_pool_drafted == c.spec_pool_accepted == 0  # nothing from A's pool
        assert eng.engine_stats()["spec_pool_tokens"] == 2 * (16 + len(want))
        a2 = go("a")
        assert a2.tokens == want
        assert c.spec_pool_accepted > 0
        assert a2.usage.spec_accepted >= c.spec_pool_accepted
    finally:
        eng.close()


def test_the_pools_are_bounded_by_spec_pool_tokens(tiny_llama_path: Any) -> None:
    eng = make_engine(tiny_llama_path, use_cache=False, speculation="suffix",
                      spec_pool_tokens=50, spec_pool_prompt_tokens=8)
    try:
        eng._ctx.logits_hook = None
        for i, tenant in enumerate(("a", "b", "c")):
            got = eng.submit(GenerationRequest(prompt_tokens=prompt(400 + i), tenant=tenant,
                                               sampling=SamplingParams(max_tokens=30))
                             ).result(timeout=300)
            n = min(50, 8 + len(got.tokens))  # only the latest tenant's pool is left
            assert eng.engine_stats()["spec_pool_tokens"] == n
    finally:
        eng.close()


@pytest.mark.parametrize("kind", ["right", "first"])
def test_per_request_and_engine_counts_are_exact(tiny_llama_path: Any, reference: Any,
                                                 kind: str) -> None:
    """A deterministic draft source, k from 2 (spec_max_draft=4), 11 tokens: the first
    token comes from the prefill; "right" drafts 2, 4, 4 tokens (all accepted; the last
    verify's draft runs past max_tokens), "first" drafts 2 tokens five times with only
    the first one right (k stays 2)."""
    toks = prompt(0)
    want = reference[toks][:11]
    eng = make_engine(tiny_llama_path, use_cache=False, speculation="suffix",
                      spec_max_draft=4)
    try:
        eng._ctx.logits_hook = None

        def source(r: Any, k: int) -> list[int]:
            truth: list[int] = reference[toks][len(r.output):len(r.output) + k]
            return truth if kind == "right" else truth[:1] + [(t + 1) % 1000 for t in truth[1:]]

        eng._ctx.speculator.source = source
        got = run(eng, toks, max_tokens=11)
        assert got.tokens == want
        verifies, drafted, accepted = (3, 10, 10) if kind == "right" else (5, 10, 5)
        assert (got.usage.spec_drafted, got.usage.spec_accepted) == (drafted, accepted)
        assert got.usage.to_dict()["spec_drafted"] == drafted
        st = eng.engine_stats()
        assert (st["spec_verifies"], st["spec_drafted"], st["spec_accepted"]) == \
            (verifies, drafted, accepted)
        assert st["spec_pool_drafted"] == 0  # injected drafts are not the pool's
        assert st["spec_acceptance_rate"] == round(accepted / drafted, 4)
        assert st["spec_mean_accepted"] == round(accepted / verifies, 4)
        assert st["spec_tokens_per_forward"] == round(1 + accepted / verifies, 4)
        assert st["spec_pool_tokens"] == len(toks) + 11  # the whole prompt (< 256) + output
        # one decode step per verify forward ("first": a sixth reports the last pending
        # token, which ends the request before any forward)
        assert eng.counters.decode_steps == (3 if kind == "right" else 6)
    finally:
        eng.close()


def test_no_speculation_reports_no_rates(tiny_llama_path: Any) -> None:
    eng = make_engine(tiny_llama_path, use_cache=False, speculation="off")
    try:
        got = run(eng, prompt(0), max_tokens=4)
        assert (got.usage.spec_drafted, got.usage.spec_accepted) == (0, 0)
        st = eng.engine_stats()
        assert st["spec_pool_tokens"] == 0
        assert st["spec_acceptance_rate"] is None and st["spec_tokens_per_forward"] is None
    finally:
        eng.close()


def test_a_restarted_engine_drafts_from_the_token_ids_the_ssd_stores(tiny_llama_path: Any,
                                                                     tmp_path: Any) -> None:
    """The draft pool is seeded from the cache's stored token ids: a fresh engine on
    the same SSD folder, with no request before in its process, gets pool drafts
    (accepted) from the previous process's reply, the same tokens as without
    speculation; another tenant's first request gets none of them."""
    from promptcache.cli.wiring import build_cache
    from promptcache.config import CacheConfig, SSDConfig
    from promptcache.engine.engine import Engine
    from promptcache.serving_config import EngineConfig

    toks = tuple(int(t) for t in np.random.default_rng(301).integers(3, 1000, size=40))
    plain = make_engine(tiny_llama_path, use_cache=False)
    try:
        want = run(plain, toks).tokens
    finally:
        plain.close()
    ssd = SSDConfig(path=tmp_path / "blocks", policy="write_through", fsync=False)
    cc = CacheConfig(block_size=8, ram_budget_bytes=64 * 1024**2)
    ec = EngineConfig(restore_plan="load", prefill_chunk_tokens=16, speculation="suffix",
                      spec_verify_cost=(1.0, 0.0))

    def go(eng: Engine, tenant: str) -> Any:
        return eng.submit(GenerationRequest(prompt_tokens=toks, tenant=tenant,
                                            sampling=SamplingParams(max_tokens=40))
                          ).result(timeout=300)

    with Engine.load(tiny_llama_path, ec, cc, cache=build_cache(cc, ssd)) as first:
        assert go(first, "a").tokens == want
    with Engine.load(tiny_llama_path, ec, cc, cache=build_cache(cc, ssd)) as second:
        c = counts(second._ctx)
        got = go(second, "a")
        assert got.tokens == want
        # the prompt and the reply but its last token (end-of-generation save point)
        assert c.spec_pool_seeded == len(toks) + len(want) - 1
        assert c.spec_pool_accepted > 0
        seeded, pooled = c.spec_pool_seeded, c.spec_pool_drafted
        assert go(second, "b").tokens == want
        # b's history is b's own prompt, stored when its prefill ended: nothing of a's
        assert (c.spec_pool_seeded, c.spec_pool_drafted) == (seeded + len(toks), pooled)
        st = second.engine_stats()
        assert st["spec_pool_seeded"] == seeded + len(toks)
        # + a's and b's finished requests (prompt and reply each)
        assert st["spec_pool_tokens"] == seeded + len(toks) + 2 * (len(toks) + len(want))
        assert st["spec_pool_ngrams"] > 0
