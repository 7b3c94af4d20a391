"""Speculation's gate (engine/spec_cost.py): decisions from injected costs and
acceptance, never from timing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import make_engine

from promptcache.engine.api import GenerationRequest, SamplingParams
from promptcache.engine.spec_cost import (
    FREE,
    Acceptance,
    VerifyCost,
    expected_tokens,
    plan,
)

# a CPU-like forward: the weights cost 10, each position 1 (a verify of 8 drafts: 1.64x)
CPU = VerifyCost(10.0, 1.0)
# a forward whose cost is all per position (a verify of k drafts costs k + 1 steps)
LINEAR = VerifyCost(0.0, 1.0)


def test_relative_cost() -> None:
    assert CPU.relative(1, 1) == 1.0
    assert CPU.relative(1, 9) == pytest.approx(19 / 11)
    assert CPU.relative(4, 5) == pytest.approx(30 / 14)
    assert FREE.relative(8, 17) == 1.0
    assert LINEAR.relative(2, 5) == 5.0
    with pytest.raises(ValueError):
        VerifyCost(0.0, 0.0)
    with pytest.raises(ValueError):
        VerifyCost(-1.0, 1.0)


def test_acceptance_rate_from_decayed_counts() -> None:
    a = Acceptance()
    assert a.rate == pytest.approx(2 / 3)  # the prior: 2 accepted, 1 rejected
    a.update(4, 4)
    assert (a.accepted, a.rejected) == (pytest.approx(5.8), pytest.approx(0.9))
    a.update(4, 0)
    assert (a.accepted, a.rejected) == (pytest.approx(5.22), pytest.approx(1.81))
    assert a.rate == pytest.approx(5.22 / 7.03)
    b = Acceptance()
    for _ in range(7):
        b.update(2, 0)
    # 2-token drafts that always fail: verified 7 times on a CPU-like cost, then not
    assert b.rate == pytest.approx(2 * 0.9 ** 7 / (2 * 0.9 ** 7 + 0.9 ** 7 + sum(
        0.9 ** i for i in range(7))))
    assert plan([b.rate], [2], CPU) == 0
    assert expected_tokens(0.5, 3) == 1.875
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0


def test_the_gate_cuts_drafts_to_what_pays() -> None:
    # a row that copies (rate 0.95): the whole draft pays even on a CPU-like cost
    assert plan([0.95], [8], CPU) == 8
    # a chat row whose drafts fail (rate 0.1): no verify
    assert plan([0.1], [8], CPU) == 0
    # a verify that costs k + 1 steps never pays unless every token is accepted
    assert plan([0.9], [8], LINEAR) == 0
    assert plan([1.0], [8], LINEAR) == 0  # (9 tokens for 9 steps: no gain over MARGIN)
    # free verify: any chance of a token pays
    assert plan([0.2], [3], FREE) == 3
    # no draft at all
    assert plan([0.9, 0.9], [0, 0], FREE) == 0
    # a middling rate: the cut where expected tokens per cost is best
    assert plan([0.6], [16], CPU) == 3


def test_the_gate_for_several_rows_and_array_states() -> None:
    # two rows: one copies, one has nothing; one forward serves both
    assert plan([0.95, 0.5], [8, 0], CPU) == 8
    # eight rows, only one with a draft: its tokens do not pay for 8 rows' wider forward
    assert plan([0.95] + [0.5] * 7, [8] + [0] * 7, CPU) == 0
    # array states: a likely rejection costs a second forward
    assert plan([0.6], [8], CPU, state=False) == 3
    assert plan([0.6], [8], CPU, state=True) == 0
    assert plan([0.98], [8], CPU, state=True) == 8
    # rows keep as many positions as the shortest: one row without a draft stops all
    assert plan([0.95, 0.95], [8, 0], FREE, state=True, uniform=True) == 0
    assert plan([0.95, 0.95], [8, 8], CPU, state=True, uniform=True) == 8


def test_a_chat_turn_with_nothing_to_copy_decodes_without_verifies(tiny_llama_path: Any
                                                                   ) -> None:
    """Wrong drafts on every step, a CPU-like cost: after the first rejections the gate
    stops verifying; the tokens are those of decoding without speculation."""
    toks = tuple(int(t) for t in np.random.default_rng(5).integers(3, 1000, size=40))
    plain = make_engine(tiny_llama_path, use_cache=False)
    try:
        want = plain.submit(GenerationRequest(prompt_tokens=toks, sampling=SamplingParams(
            max_tokens=80))).result(timeout=300).tokens
    finally:
        plain.close()
    eng = make_engine(tiny_llama_path, use_cache=False, speculation="suffix",
                      spec_verify_cost=(10.0, 1.0), spec_max_draft=4)
    try:
        eng._ctx.logits_hook = None
        eng._ctx.speculator.source = lambda r, k: [(t + 1) % 1000 for t in want[
            len(r.output):len(r.output) + k]]
        got = eng.submit(GenerationRequest(prompt_tokens=toks, sampling=SamplingParams(
            max_tokens=80))).result(timeout=300)
        assert got.tokens == want
        c = eng.counters
        # the prior (1/2) pays for drafts; each rejection lowers the rate (and pauses
        # drafting for 1, 2, 4, 8, 16 steps); after the seventh (test_acceptance_rate...)
        # the gate decodes as usual
        assert (c.spec_verifies, c.spec_accepted) == (7, 0)
        assert c.spec_gated > 0
        st = eng.engine_stats()
        assert st["spec_verify_cost"]["k8"] == round(19 / 11, 3)
    finally:
        eng.close()


def test_the_cost_is_measured_at_startup_without_a_configured_one(tiny_llama_path: Any
                                                                  ) -> None:
    """No spec_verify_cost: the engine fits one from forwards of its model (the numbers
    are timings: only their form is checked)."""
    from promptcache.engine.spec_cost import measure_verify_cost

    eng = make_engine(tiny_llama_path, use_cache=False, speculation="suffix",
                      spec_verify_cost=None)
    try:
        cost = eng._ctx.speculator.cost
        assert isinstance(cost, VerifyCost) and cost.overhead > 0 and cost.per_token >= 0
        rel = eng.engine_stats()["spec_verify_cost"]
        assert list(rel) == ["k1", "k2", "k4", "k8", "k16"]
        assert 1.0 <= rel["k1"] <= rel["k16"]
        again = measure_verify_cost(eng._ctx.model, eng._ctx.vocab_size, repeats=1)
        assert again.overhead > 0
    finally:
        eng.close()
