"""Speculative decoding of constrained rows (grammar-checked drafts): a draft is cut at
the first token the grammar rejects (``constrained.grammar_prefix``), each position is
masked only after the draft tokens before it were accepted, so the matcher consumes
exactly the kept tokens; the output is that of decoding one token at a time, whatever the
drafts propose (right, wrong but valid, rejected by the grammar, half right)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from conftest import counts, make_engine

from promptcache.engine.api import Constraint, GenerationRequest, SamplingParams
from promptcache.engine.speculation.speculator import Speculator

DIGITS = Constraint("regex", "[0-9]{1,200}")
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "args": {"type": "array", "items": {"type": "integer"}, "maxItems": 6}},
    "required": ["name", "args"], "additionalProperties": False}
TOOL = Constraint("json_schema", json.dumps(SCHEMA))
CONSTRAINTS = {"digits": DIGITS, "tool": TOOL}
MAX_TOKENS = 40


def prompt(seed: int) -> tuple[int, ...]:
    rng = np.random.default_rng(seed)
    return tuple(int(t) for t in rng.integers(3, 1000, size=40))


def request(toks: tuple[int, ...], constraint: Constraint, **sp: Any) -> GenerationRequest:
    return GenerationRequest(prompt_tokens=toks, sampling=SamplingParams(
        max_tokens=MAX_TOKENS, **sp), constraint=constraint)


@pytest.fixture(scope="module")
def plain(tiny_llama_path: Any) -> Any:
    eng = make_engine(tiny_llama_path, use_cache=False)
    yield eng
    eng.close()


def ids(eng: Any, text: str) -> list[int]:
    return [int(t) for t in eng._ctx.tokenizer.encode(text, add_special_tokens=False)]


def source_of(kind: str, want: dict[tuple[int, ...], list[int]], bad: int) -> Any:
    """Drafts from the reference reply: right; right with each token off by one (valid
    or not); the grammar's rejected token everywhere; right then rejected."""

    def source(r: Any, k: int) -> list[int]:
        truth = want[tuple(r.req.prompt_tokens)][len(r.output):len(r.output) + k]
        if kind == "right":
            return truth
        if kind == "shifted":
            return [(t + 1) % 1000 for t in truth]
        if kind == "rejected":
            return [bad] * k
        half = max(1, len(truth) // 2)
        return truth[:half] + [bad] * (k - half)

    return source


@pytest.mark.parametrize("name", ["digits", "tool"])
@pytest.mark.parametrize("kind", ["right", "shifted", "rejected", "half"])
def test_constrained_greedy_output_equals_decoding_one_token_at_a_time(
        tiny_llama_path: Any, plain: Any, name: str, kind: str) -> None:
    constraint = CONSTRAINTS[name]
    prompts = [prompt(s) for s in range(2)]
    want = {p: plain.submit(request(p, constraint)).result(timeout=300).tokens
            for p in prompts}
    eng = make_engine(tiny_llama_path, use_cache=False, speculation="suffix",
                      spec_max_draft=6)
    try:
        eng._ctx.logits_hook = None
        spec = eng._ctx.speculator
        assert isinstance(spec, Speculator)
        bad = ids(eng, "Q")[-1]  # a letter: never a digit, never a JSON key's opening
        spec.source = source_of(kind, want, bad)
        for p in prompts:  # one at a time, then both in one batch
            assert eng.submit(request(p, constraint)).result(timeout=300).tokens == want[p]
        handles = [eng.submit(request(p, constraint)) for p in prompts]
        assert [h.result(timeout=300).tokens for h in handles] == [want[p] for p in prompts]
        c = counts(eng._ctx)
        if kind == "right":
            assert c.spec_verifies > 0 and c.spec_accepted == c.spec_drafted > 0
            assert c.spec_grammar_cut == 0
        if kind == "rejected" and name == "digits":
            # every draft is cut to nothing before a verify
            assert c.spec_verifies == 0 and c.spec_grammar_cut > 0
        if kind == "half":
            assert c.spec_accepted > 0 and c.spec_grammar_cut > 0
    finally:
        eng.close()


def test_constrained_sampled_output_and_logprobs_equal_decoding_one_at_a_time(
        tiny_llama_path: Any, plain: Any) -> None:
    """temperature > 0 with a seed and logprobs: the same tokens, and each token's
    log-probability from the grammar-masked distribution at its position."""
    p = prompt(11)
    sp = {"temperature": 0.8, "seed": 5, "logprobs": 2}

    def events(eng: Any) -> list[Any]:
        h = eng.submit(request(p, TOOL, **sp))
        return [ev for ev in h.events() if hasattr(ev, "logprob")]

    want = events(plain)
    eng = make_engine(tiny_llama_path, use_cache=False, speculation="suffix",
                      spec_max_draft=6)
    try:
        eng._ctx.logits_hook = None
        truth = [e.token_id for e in want]
        eng._ctx.speculator.source = lambda r, k: truth[len(r.output):len(r.output) + k]
        got = events(eng)
        assert [e.token_id for e in got] == truth
        for g, w in zip(got, want, strict=True):
            assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
            assert [t for t, _ in g.top_logprobs] == [t for t, _ in w.top_logprobs]
        assert counts(eng._ctx).spec_accepted > 0
    finally:
        eng.close()
