"""Speculation's gate (engine/speculation/cost.py): decisions from injected costs and
acceptance, never from timing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import counts, make_engine, speculating
from hypothesis import given, settings
from hypothesis import strategies as st

from promptcache.engine.api import GenerationRequest, SamplingParams
from promptcache.engine.speculation.cost import (
    ALPHA,
    FIT_WEIGHT,
    FREE,
    MEASURE_CONTEXT,
    OUTLIERS_IN_A_ROW,
    OnlineCost,
    TableCost,
    VerifyCost,
    context_bucket,
)
from promptcache.engine.speculation.gate import (
    Acceptance,
    Credits,
    expected_tokens,
    plan,
    row_share,
    row_tokens,
    shared_tokens,
    verify_price,
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


def test_the_bystander_bound() -> None:
    """A row without a draft gets 1 token for the verify's price: it may lose only its
    allowance (decode steps)."""
    # CPU, two rows, one copies (8 drafts at 0.95), one has nothing: cut 8 costs 28/12
    # decode steps, so the row with nothing loses 4/3 steps; cut 1 costs 14/12 (1/6 lost)
    assert plan([0.95, 0.5], [8, 0], CPU, allowance=[0.0, 4 / 3 + 1e-9]) == 8
    assert plan([0.95, 0.5], [8, 0], CPU, allowance=[0.0, 1.0]) == 6  # 26/12: 7/6 lost
    assert plan([0.95, 0.5], [8, 0], CPU, allowance=[0.0, 1 / 6 + 1e-9]) == 1
    assert plan([0.95, 0.5], [8, 0], CPU, allowance=[0.0, 0.1]) == 0
    assert plan([0.95, 0.5], [8, 0], CPU, allowance=[0.0, 0.0]) == 0
    # every row drafts and each expects more than the price: no allowance needed
    assert plan([0.95, 0.95], [8, 8], CPU, allowance=[0.0, 0.0]) == 8
    # a weak row's expectation below the price is a loss too (0.3: 1.43 tokens at cut 8)
    # (cut 2: 1.39 tokens for 16/12 steps; cut 3: 1.417 for 18/12)
    assert plan([0.95, 0.3], [8, 8], CPU, allowance=[0.0, 0.0]) == 2
    # FREE: a verify costs a decode step, nobody loses anything
    assert plan([0.9, 0.5], [4, 0], FREE, allowance=[0.0, 0.0]) == 4


def test_a_rows_share_of_a_decode_step() -> None:
    """What a row adds to a decode step of the batch, as a share of it (the fit's)."""
    assert row_share(CPU, 8) == pytest.approx(1 - 17 / 18)  # steps of 10 + 1 per row
    assert row_share(CPU, 4) == pytest.approx(1 / 14)
    assert row_share(CPU, 1) == 0.0
    assert row_share(OnlineCost(CPU), 8) == pytest.approx(1 / 18)  # the startup fit's
    # each row's attention to its context is part of what it adds: 1 + 2 per row here
    assert row_share(VerifyCost(1.0, 1.0, attend=0.001, at=1000), 8, 2000) == \
        pytest.approx(1 - 15 / 17)
    # a fixed cost says nothing of rows; a verify as cheap as a step shares nothing
    assert row_share(TableCost((1.5,)), 8) == 0.0
    assert row_share(FREE, 8) == 0.0


def test_what_a_verify_is_worth_to_each_row() -> None:
    """A row's own expected tokens, plus the share of a step for each token beyond one
    the verify gives the rows with no more tokens left than it (they leave the batch
    that many steps sooner while it still decodes there)."""
    per_row = [4.0, 3.0, 1.0, 1.0]
    assert shared_tokens(per_row, 0.1, [10, 10, 10, 5]) == pytest.approx(
        [4.0 + 0.1 * 2.0, 3.0 + 0.1 * 3.0, 1.0 + 0.1 * 5.0, 1.0])
    assert shared_tokens(per_row, 0.1, [5, 10, 20, 30]) == pytest.approx(
        [4.0, 3.0 + 0.1 * 3.0, 1.0 + 0.1 * 5.0, 1.0 + 0.1 * 5.0])
    assert shared_tokens(per_row, 0.0, [10, 10, 10, 10]) == per_row


def test_the_bystander_bound_counts_the_steps_the_others_save_it() -> None:
    """CPU, four rows: three copy (8 drafts at 0.95), one copies badly (0.5). Alone the
    weak row gains from a verify only up to a cut of 3 (1.875 tokens for 13/7 steps);
    the others' gains make them leave the batch sooner, and each of those steps is
    1/14 cheaper for it, so it gains from the cut that pays best over the four (6)."""
    rates, lengths = [0.95, 0.95, 0.95, 0.5], [8, 8, 8, 8]
    share = row_share(CPU, 4)
    assert plan(rates, lengths, CPU) == 6
    assert plan(rates, lengths, CPU, allowance=[0.0] * 4) == 3
    assert plan(rates, lengths, CPU, allowance=[0.0] * 4, share=share, left=[50] * 4) == 6
    # the weak row is due to finish first: the others finishing sooner saves it nothing
    assert plan(rates, lengths, CPU, allowance=[0.0] * 4, share=share,
                left=[50, 50, 50, 49]) == 3
    # a row with nothing to copy is never paid for by the others' gains here: each
    # verify position costs it 4/14 of a step, each token beyond one they get 1/14
    for q in (0.95, 1.0):
        assert plan([q, q, q, 0.5], [8, 8, 8, 0], CPU, allowance=[0.0] * 4, share=share,
                    left=[50] * 4) == 0


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(0, 8), st.floats(0.0, 3.0),
                               st.integers(1, 100)), min_size=1, max_size=8),
       share=st.floats(0.0, 0.3))
def test_a_planned_verify_keeps_every_row_within_its_allowance(
        rows: list[tuple[float, int, float, int]], share: float) -> None:
    """Whatever the rows: a verify the gate plans is worth at least its price less the
    allowance to every row (its tokens and what the others' gains save it), counting
    the others never makes a verify worth less to a row, and a verify the bound allowed
    without the others' gains it allows with them."""
    rates, lengths, allowance, left = (list(c) for c in zip(*rows, strict=True))
    cut = plan(rates, lengths, CPU, allowance=allowance, share=share, left=left)
    if cut:
        per_row = row_tokens(rates, lengths, cut)
        price = verify_price(rates, lengths, cut, CPU, tokens=sum(per_row))
        worth = shared_tokens(per_row, share, left)
        assert all(w - price >= -a - 1e-9 for w, a in zip(worth, allowance, strict=True))
        assert all(w >= t - 1e-12 for w, t in zip(worth, per_row, strict=True))
    if plan(rates, lengths, CPU, allowance=allowance, left=left):
        assert cut > 0


def test_credits_are_what_verifies_saved_a_row() -> None:
    credits = Credits(0.05)
    assert credits.allowance("a", 0) == 0.0
    assert credits.allowance("a", 40) == pytest.approx(2.0)  # 5% of 40 decoded tokens
    credits.settle("a", 1.0, 1.5)  # a bystander of a verify costing 1.5 decode steps
    assert credits.balance("a") == pytest.approx(-0.5)
    credits.settle("a", 4.2, 2.0)  # its own draft: 4.2 tokens expected for 2 steps
    assert credits.balance("a") == pytest.approx(1.7)
    assert credits.allowance("a", 40) == pytest.approx(3.7)
    credits.forget("a")
    assert credits.balance("a") == 0.0
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            Credits(bad)
    from promptcache.serving_config import EngineConfig

    assert EngineConfig().spec_max_slowdown == 0.0
    with pytest.raises(ValueError):
        EngineConfig(spec_max_slowdown=-1.0)


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
        c = counts(eng._ctx)
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
    from promptcache.engine.speculation.cost import measure_verify_cost

    eng = make_engine(tiny_llama_path, use_cache=False, speculation="suffix",
                      spec_verify_cost=None)
    try:
        online = eng._ctx.speculator.cost
        assert isinstance(online, OnlineCost)  # the fit, corrected while serving
        cost = online.prior
        assert isinstance(cost, VerifyCost) and cost.overhead > 0 and cost.per_token >= 0
        assert cost.at == MEASURE_CONTEXT and cost.attend >= 0  # llama: trimmable
        rel = eng.engine_stats()["spec_verify_cost"]
        assert list(rel) == ["k1", "k2", "k4", "k8", "k16"]
        assert 1.0 <= rel["k1"] <= rel["k16"]
        again = measure_verify_cost(eng._ctx.model, eng._ctx.vocab_size, repeats=1)
        assert again.overhead > 0
    finally:
        eng.close()


# --- the cost corrected online (spec_cost.OnlineCost) and --spec-verify-cost ------------


def _weighed(ratio: float, samples: int) -> float:
    """A bucket's correction: its running ratio against the fit's 1.0 (FIT_WEIGHT samples)."""
    return (FIT_WEIGHT + samples * ratio) / (FIT_WEIGHT + samples)


def test_measured_verify_costs_replace_the_startup_fit() -> None:
    fit = VerifyCost(10.0, 1.0)  # k=2: 13/11 decode steps
    cost = OnlineCost(fit)
    assert cost.relative(1, 3) == pytest.approx(13 / 11)  # no samples: the fit
    assert cost.decode_seconds(1) == 11.0  # the fit's own time, until measured
    cost.observe_decode(1, 2.0)
    cost.observe_verify(1, 3, 6.0)  # k=2 took 3 decode steps: 33/13 the fit's
    ratio = 3.0 / (13 / 11)
    # one sample moves the price a quarter of the way (the fit weighs 3 samples) ...
    assert FIT_WEIGHT == 3.0
    assert cost.correction(2) == pytest.approx(_weighed(ratio, 1)) == pytest.approx(
        (3.0 + ratio) / 4)
    assert cost.relative(1, 3) == pytest.approx(13 / 11 * (3.0 + ratio) / 4)
    # ... and the measurements outweigh it as they come (the mean of four: the same)
    for _ in range(3):
        cost.observe_verify(1, 3, 6.0)
    assert cost.relative(1, 3) == pytest.approx(13 / 11 * (3.0 + 4 * ratio) / 7)
    c = cost.correction(2)
    # k = 1, 4, 8 (other buckets) take the nearest measured bucket's correction
    assert cost.relative(1, 5) == pytest.approx(fit.relative(1, 5) * c)
    assert cost.relative(1, 2) == pytest.approx(fit.relative(1, 2) * c)
    assert cost.relative(1, 9) == pytest.approx(fit.relative(1, 9) * c)
    assert cost.relative(1, 1) == 1.0
    # the mean of the first samples: a k=2 verify at exactly the fit's cost (ratio 1)
    # makes the bucket's ratio the mean of five; a k=3 one starts its own bucket (3-4)
    cost.observe_verify(1, 3, 2.0 * fit.relative(1, 3))
    mean = (4 * ratio + 1.0) / 5
    assert cost.correction(2) == pytest.approx(_weighed(mean, 5))
    cost.observe_verify(1, 4, 2.0 * fit.relative(1, 4))
    assert cost.correction(3) == cost.correction(4) == pytest.approx(1.0)
    assert cost.correction(2) == pytest.approx(_weighed(mean, 5))
    # the mean up to 1 / ALPHA samples, then each moves it by ALPHA
    n = round(1 / ALPHA)
    assert n == 5
    cost.observe_verify(1, 3, 2.0 * 2 * fit.relative(1, 3))  # twice the fit
    was = mean + ALPHA * (2.0 - mean)
    assert cost.correction(2) == pytest.approx(_weighed(was, 6))
    # never cheaper than a decode step
    cheap = OnlineCost(fit)
    cheap.observe_decode(1, 2.0)
    for _ in range(20):
        cheap.observe_verify(1, 3, 0.5)
    assert cheap.relative(1, 3) == 1.0


def test_outliers_are_skipped_unless_they_persist() -> None:
    cost = OnlineCost(FREE)
    cost.observe_decode(1, 1.0)
    cost.observe_decode(1, 100.0)  # a prefill chunk ran between two steps
    assert cost.decode_seconds(1) == 1.0
    for _ in range(OUTLIERS_IN_A_ROW):
        cost.observe_decode(1, 100.0)  # the machine did get slower
    assert cost.decode_seconds(1) > 1.0
    # another row count: scaled from the nearest measured one by the fit
    two = OnlineCost(VerifyCost(1.0, 1.0))
    two.observe_decode(1, 4.0)
    assert two.decode_seconds(3) == pytest.approx(4.0 * 4 / 2)


def test_a_verify_is_priced_against_steps_over_its_own_context() -> None:
    """Plain steps are timed per batch size and context octave, as ratios to the fit's
    step over their own context: a verify over 2,300 tokens after steps timed only over
    a few (a short warm-up request) is compared with what a step over 2,300 tokens is
    expected to take, not with the short steps."""
    # a step: 1 + 1 per row over 1,000 tokens, 0.001 more per row per token beyond
    fit = VerifyCost(1.0, 1.0, attend=0.001, at=1000)
    assert fit.step(1, 1000) == 2.0 and fit.step(1, 2300) == pytest.approx(3.3)
    assert fit.step(2, 2300) == pytest.approx(5.6) and fit.step(1, 0) == 1.0
    assert VerifyCost(1.0, 0.5, attend=0.001, at=1000).step(1, 0) == 1.0  # the floor
    assert [context_bucket(n) for n in (0, 255, 256, 511, 512, 2047, 2048, 2300)] == \
        [0, 0, 1, 1, 2, 3, 4, 4]
    cost = OnlineCost(fit)
    for _ in range(3):
        cost.observe_decode(1, 0.5, context=0)  # the warm-up: half the fit's step
    assert cost.decode_seconds(1, 0) == pytest.approx(0.5)
    # not timed over 2,300 tokens yet: the nearest octave's ratio at this context
    assert cost.decode_seconds(1, 2300) == pytest.approx(0.5 * 3.3)
    # a k=1 verify there that took the fit's relative cost x that step: no correction
    cost.observe_verify(1, 2, 0.5 * 3.3 * fit.relative(1, 2), context=2300)
    assert cost.correction(1) == pytest.approx(1.0)
    # steps over the long context: their own octave's ratio (0.8), the short one kept
    cost.observe_decode(1, 0.8 * 3.3, context=2300)
    assert cost.decode_seconds(1, 2400) == pytest.approx(0.8 * 3.4)
    assert cost.decode_seconds(1, 100) == pytest.approx(0.5 * 1.1)
    # another size: the same octave first (2 rows over 2,300: 0.8 x its fit) ...
    assert cost.decode_seconds(2, 2300) == pytest.approx(0.8 * 5.6)
    # ... then the nearest size in it (8 rows measured at 9x their fit)
    cost.observe_decode(8, 9.0 * fit.step(8, 3000), context=3000)
    assert cost.decode_seconds(2, 10) == pytest.approx(0.5 * fit.step(2, 10))
    assert cost.decode_seconds(3, 2100) == pytest.approx(0.8 * fit.step(3, 2100))
    assert cost.decode_seconds(7, 2100) == pytest.approx(9.0 * fit.step(7, 2100))
    assert cost.decode_seconds(7, 4500) == pytest.approx(9.0 * fit.step(7, 4500))
    # the guard compares a window of verify steps with plain steps over its context
    cost.guard.observe_step(1, 4, 4 * 0.8 * 3.3, context=2300)
    for _ in range(3):
        cost.guard.observe_step(1, 4, 4 * 0.8 * 3.3, context=2300)
    assert cost.guard.turned_off == 0  # a token per step over 2,300 tokens: decoding's
    for _ in range(4):
        cost.guard.observe_step(1, 4, 4 * 0.8 * 3.3, context=100)
    assert cost.guard.turned_off == 1  # over 100 tokens a step takes 0.5 x 1.1 s


class ContextSpy(OnlineCost):
    """``ScriptedCost``'s fixed timings, recording the context of every timed step."""

    def __init__(self) -> None:
        super().__init__(FREE)
        self.contexts: list[tuple[str, int]] = []

    def observe_decode(self, rows: int, seconds: float, context: int = 0) -> None:
        self.contexts.append(("decode", context))
        super().observe_decode(rows, 1.0, context)

    def observe_verify(self, rows: int, width: int, seconds: float, context: int = 0
                       ) -> None:
        self.contexts.append(("verify", context))
        super().observe_verify(rows, width, 1.0 + 0.01 * (width - 1), context)


def test_steps_and_verifies_are_timed_with_the_tokens_they_attend_to(tiny_llama_path: Any
                                                                     ) -> None:
    """The batch reports each plain step and each verify with its row's tokens in the
    cache: in the order of the steps, every one over more tokens than the one before,
    all between the prompt and the prompt plus the reply."""
    spy = ContextSpy()
    toks, want, eng = speculating(tiny_llama_path, 3, 48, 4, spy)
    try:
        spec = eng._ctx.speculator
        spec.source = lambda r, k: [(t + 1) % 1000 for t in want[
            len(r.output):len(r.output) + k]]  # wrong: every step adds one token
        got = eng.submit(GenerationRequest(prompt_tokens=toks, sampling=SamplingParams(
            max_tokens=60))).result(timeout=300)
        assert got.tokens == want
        kinds = {k for k, _ in spy.contexts}
        assert kinds == {"decode", "verify"}
        seen = [n for _, n in spy.contexts]
        assert seen == sorted(set(seen)), spy.contexts
        assert len(toks) - 1 <= seen[0] and seen[-1] < len(toks) + 60
    finally:
        eng.close()


def test_fixed_verify_costs_from_the_setting() -> None:
    from promptcache.serving_config import EngineConfig, verify_cost_steps

    assert verify_cost_steps("auto") is None and verify_cost_steps(None) is None
    assert verify_cost_steps("0.5") == (1.5,)
    assert verify_cost_steps("1.5, 2,3") == (1.5, 2.0, 3.0)
    one = TableCost(verify_cost_steps("0.5") or ())
    assert [one.relative(4, 1 + k) for k in (0, 1, 2, 8)] == [1.0, 1.5, 2.0, 5.0]
    table = TableCost((1.5, 2.0, 3.0))
    assert [table.relative(1, 1 + k) for k in (1, 2, 3, 4, 6)] == [1.5, 2.0, 3.0, 4.0, 6.0]
    assert TableCost.per_position(0.25).relative(1, 5) == 2.0
    for bad in ("fast", "-1", "nan", "inf", "1.5,0.5", "1,,2", ""):
        with pytest.raises(ValueError):
            EngineConfig(spec_verify_cost=bad)
    with pytest.raises(ValueError):
        EngineConfig(spec_verify_cost=(0.0, 0.0))
    assert EngineConfig().spec_verify_cost == "auto"
    EngineConfig(spec_verify_cost="0"), EngineConfig(spec_verify_cost="1,1.2")


class ScriptedCost(OnlineCost):
    """What the online correction measures, scripted instead of timed: a plain decode
    step takes 1 s, a verify of ``rows x width`` takes ``verify(width)`` s (the batch's
    clock readings are ignored: deterministic)."""

    def __init__(self, verify: Any) -> None:
        super().__init__(FREE)  # the startup fit: a verify costs a decode step
        self.verify = verify

    def observe_decode(self, rows: int, seconds: float, context: int = 0) -> None:
        super().observe_decode(rows, 1.0)

    def observe_verify(self, rows: int, width: int, seconds: float, context: int = 0
                       ) -> None:
        super().observe_verify(rows, width, self.verify(width))

    def observe_step(self, rows: int, width: int, tokens: int, seconds: float,
                     context: int = 0) -> None:
        pass  # the whole-step guard (StepGuard) is tested on its own


@pytest.mark.parametrize("verify", ["expensive", "cheap"])
@pytest.mark.parametrize("drafts", ["wrong", "right"])
def test_the_gate_follows_the_measured_cost(tiny_llama_path: Any, verify: str,
                                            drafts: str) -> None:
    """The fit says a verify is free; the measured cost says a verify of k drafts costs
    1 + 0.5 k decode steps (expensive) or 1 + 0.01 k (cheap). Wrong drafts: with the
    expensive cost the row stops drafting after its first verifies (the fit weighs
    FIT_WEIGHT samples, so each draft-length bucket's first verify moves its price a
    quarter of the way; then it probes rarely), with the cheap one it keeps verifying
    between cool-downs. Right
    drafts pay either way. The tokens are those of decoding one at a time."""
    slope = 0.5 if verify == "expensive" else 0.01
    toks, want, eng = speculating(tiny_llama_path, 3, 48, 8,
                                  ScriptedCost(lambda width: 1.0 + slope * (width - 1)))
    try:
        spec = eng._ctx.speculator
        shift = 1 if drafts == "wrong" else 0
        spec.source = lambda r, k: [(t + shift) % 1000 for t in want[
            len(r.output):len(r.output) + k]]
        got = eng.submit(GenerationRequest(prompt_tokens=toks, sampling=SamplingParams(
            max_tokens=60))).result(timeout=300)
        assert got.tokens == want
        c = counts(eng._ctx)
        assert spec.cost.verify_samples == c.spec_verifies > 0
        if drafts == "right":
            assert c.spec_accepted == c.spec_drafted
            assert c.spec_paused == 0
            assert c.decode_steps < 60 // 2
        elif verify == "expensive":
            # k = 4, 2, 1, 1 (cool-downs of 1, 2, 4 steps between) until the measured
            # price outweighs the fit, then paused: its probe comes 16 steps later
            assert c.spec_verifies == 4 and c.spec_accepted == 0 and c.spec_paused >= 1
        else:
            assert c.spec_verifies >= 5 and c.spec_accepted == 0 and c.spec_paused == 0
    finally:
        eng.close()


def two_rows(path: Any, seed: int) -> tuple[list[tuple[int, ...]], dict[tuple[int, ...],
                                                                        list[int]], Any]:
    """Two random 40-token prompts, the 60 tokens decoding one at a time gives for each,
    and a speculating engine (drafts of up to 8) whose verify costs 1 + 0.25 k decode
    steps, scripted."""
    rng = np.random.default_rng(seed)
    prompts = [tuple(int(t) for t in rng.integers(3, 1000, size=40)) for _ in range(2)]
    plain = make_engine(path, use_cache=False)
    try:
        want = {p: plain.submit(GenerationRequest(prompt_tokens=p, sampling=SamplingParams(
            max_tokens=60))).result(timeout=300).tokens for p in prompts}
    finally:
        plain.close()
    eng = make_engine(path, use_cache=False, speculation="suffix", spec_max_draft=8)
    eng._ctx.logits_hook = None
    eng._ctx.speculator.cost = ScriptedCost(lambda width: 1.0 + 0.25 * (width - 1))
    return prompts, want, eng


def decode_together(eng: Any, prompts: list[tuple[int, ...]],
                    want: dict[tuple[int, ...], list[int]], source: Any) -> list[Any]:
    """Both prompts decoded together with drafts from ``source``: each gets the tokens
    of decoding one at a time (asserted); their results."""
    eng._ctx.speculator.source = source
    handles = [eng.submit(GenerationRequest(prompt_tokens=p, sampling=SamplingParams(
        max_tokens=60))) for p in prompts]
    got = [h.result(timeout=300) for h in handles]
    assert [g.tokens for g in got] == [want[p] for p in prompts]
    return got


def test_the_gate_is_per_row_in_a_batch(tiny_llama_path: Any) -> None:
    """Two rows decoding together, a verify measured at 1 + 0.25 k decode steps (of the
    batch): the row whose drafts are wrong stops drafting (pauses) after a few verifies,
    the row whose drafts are right keeps verifying (its tokens pay for the batch's wider
    forward); both get the tokens of decoding one at a time."""
    prompts, want, eng = two_rows(tiny_llama_path, 21)
    # the per-row gate alone: the wrong row may pay for the right row's verifies
    # (test_a_row_with_nothing_to_copy_is_not_slowed_by_its_batch: the bound)
    eng._ctx.speculator.credits = Credits(10.0)
    try:
        right, wrong = prompts

        def source(r: Any, k: int) -> list[int]:
            p = tuple(r.req.prompt_tokens)
            shift = 1 if p == wrong else 0
            return [(t + shift) % 1000 for t in want[p][len(r.output):len(r.output) + k]]

        got = decode_together(eng, prompts, want, source)
        good, bad = got
        c = counts(eng._ctx)
        assert good.usage.spec_accepted == good.usage.spec_drafted >= 40
        # a few drafts of 2 (k falls to MIN_K after a rejection), then paused; while
        # paused, its padding in the good row's verifies takes its (wrong) drafts as fills
        assert bad.usage.spec_accepted == 0 == c.spec_fill_accepted
        assert c.spec_drafted - c.spec_fill_drafted <= good.usage.spec_drafted + 12
        assert bad.usage.spec_drafted == c.spec_fill_drafted + (
            c.spec_drafted - c.spec_fill_drafted - good.usage.spec_drafted)
        assert c.spec_paused >= 1 and c.max_batch == 2
    finally:
        eng.close()


def test_a_row_that_drafts_nothing_fills_the_verify_padding(tiny_llama_path: Any) -> None:
    """Two rows: A's drafts are always right; B's first draft is wrong (a cool-down
    follows), then its source is right. While B cools down, A's verifies carry B's
    draft in the positions they pad anyway (a fill): accepted there, and B's
    cool-down ends; both rows get the tokens of decoding one at a time."""
    prompts, want, eng = two_rows(tiny_llama_path, 23)
    try:
        calls: dict[tuple[int, ...], int] = {}

        def source(r: Any, k: int) -> list[int]:
            p = tuple(r.req.prompt_tokens)
            calls[p] = calls.get(p, 0) + 1
            shift = 1 if p == prompts[1] and calls[p] == 1 else 0
            return [(t + shift) % 1000 for t in want[p][len(r.output):len(r.output) + k]]

        got = decode_together(eng, prompts, want, source)
        c = counts(eng._ctx)
        assert c.max_batch == 2 and c.spec_multirow >= 1
        assert c.spec_fill_accepted == c.spec_fill_drafted >= 1
        # only the first draft (k starts at spec_max_draft // 2) was wrong
        assert got[1].usage.spec_accepted == got[1].usage.spec_drafted - 4
    finally:
        eng.close()


def test_a_short_draft_goes_on_into_the_verify_padding(tiny_llama_path: Any) -> None:
    """Two rows: A's drafts are always right; B's first draft (4 tokens) is wrong at its
    last token (B's k stays 4 while A's doubles), then its source is right. A verify is as wide as
    A's draft: B's draft goes on in the positions past its own k that the verify pads
    anyway (counted as a fill, accepted there); B's own k grows from its own drafts
    only (doubling after each accepted whole). Both rows get the tokens of decoding
    one at a time."""
    prompts, want, eng = two_rows(tiny_llama_path, 23)
    spec = eng._ctx.speculator
    fed: list[tuple[int, int, bool]] = []  # B's verified drafts: (fed, own k, a fill)
    plan = spec.plan

    def spy(rows: Any, drafts: Any, cache: Any, model: Any) -> int:
        ks = {r.request_id: (spec.row(r).k or 0) for r in rows}
        cut = plan(rows, drafts, cache, model)
        for r, d in zip(rows, drafts, strict=True):
            if cut and d and tuple(r.req.prompt_tokens) == prompts[1]:
                fed.append((len(d[:cut]), ks[r.request_id],
                            spec.row(r).fill))
        return cut

    spec.plan = spy
    try:
        calls: dict[tuple[int, ...], int] = {}

        def source(r: Any, k: int) -> list[int]:
            p = tuple(r.req.prompt_tokens)
            calls[p] = calls.get(p, 0) + 1
            out = list(want[p][len(r.output):len(r.output) + k])
            if p == prompts[1] and calls[p] == 1 and len(out) > 3:
                out[3] = (out[3] + 1) % 1000
            return out

        got = decode_together(eng, prompts, want, source)
        c = counts(eng._ctx)
        assert c.max_batch == 2 and c.spec_multirow >= 1
        # B's first draft: 4 tokens (spec_max_draft // 2), the last wrong; then k = 4
        assert fed[0] == (4, 4, False) and fed[1][1] == 4
        extended = [(n, k) for n, k, fill in fed if not fill and n > k]
        assert extended and all(n <= 8 for n, _ in extended)
        assert c.spec_fill_accepted == c.spec_fill_drafted >= sum(n - k for n, k in extended)
        assert got[1].usage.spec_accepted == got[1].usage.spec_drafted - 1
    finally:
        eng.close()


def test_a_verify_charges_its_rows_the_price_it_was_planned_at() -> None:
    """The gate plans a verify within each row's allowance at the cost it knows (here
    the startup fit: a verify costs a decode step); the verify itself re-measures the
    cost (2 decode steps). Each row is charged the planned price: the bystander, with
    no credit, ends at 0, not in a debt that only a verify expected to give it more
    than it costs could repay (for a row with nothing to copy: never), which would keep
    its whole batch from verifying for the rest of its reply."""
    from types import SimpleNamespace

    from mlx_lm.models.cache import BatchKVCache

    from promptcache.engine.speculation.speculator import Speculator
    from promptcache.serving_config import EngineConfig

    cost = ScriptedCost(lambda width: 2.0)
    spec = Speculator(EngineConfig(speculation="suffix"), cost=cost)

    def row(name: str, seq: list[int]) -> Any:
        r = SimpleNamespace(request_id=name, n_prompt=len(seq) - 4, output=seq[-4:],
                            processors=[], pos=len(seq) - 1, req=SimpleNamespace(
                                tenant="t", sampling=SimpleNamespace(max_tokens=64)))
        r.seq = np.array(seq)
        return r

    copying, chat = row("copy", [5, 6, 7, 8, 9] * 4), row("chat", list(range(100, 120)))
    rows = [copying, chat]
    drafts: list[Any] = [(6, 7, 8, 9), ()]
    cut = spec.plan(rows, drafts, [BatchKVCache([0, 0])], None)
    assert cut == 4 and drafts == [(6, 7, 8, 9), ()]
    planned = spec._price
    assert planned == cost.relative(2, 5) == 1.0
    spec.observe_decode(2, 1.0, 0)
    spec.observe_verify(2, 5, 2.0, 0)
    assert cost.relative(2, 5) > 1.0  # what the verify cost, known after it
    spec.settle(rows)
    assert spec.credits.balance("chat") == 0.0  # 1 token for 1 planned decode step
    assert spec.credits.balance("copy") == pytest.approx(spec._expected[0] - 1.0)
    assert spec._expected[0] > 1.0


def test_a_verify_credits_each_row_the_steps_the_others_save_it() -> None:
    """Two rows, the startup fit a CPU-like forward (10 + 1 per position): the copying
    row's draft (4 tokens) and the other row's fill. The credit each row is settled
    with is its expected tokens plus 1/12 of a step for each token beyond one the other
    row is expected to get, when the other has no more tokens left than it; the rows'
    ``max_tokens`` decide."""
    from types import SimpleNamespace

    from mlx_lm.models.cache import BatchKVCache

    from promptcache.engine.speculation.speculator import Speculator
    from promptcache.serving_config import EngineConfig

    def row(name: str, seq: list[int], max_tokens: int) -> Any:
        r = SimpleNamespace(request_id=name, n_prompt=len(seq) - 4, output=seq[-4:],
                            processors=[], pos=len(seq) - 1, req=SimpleNamespace(
                                tenant="t", sampling=SimpleNamespace(max_tokens=max_tokens)))
        r.seq = np.array(seq)
        return r

    # the same tokens left as the copying row: the fill (at the fills' rate, 1/3) pays
    # its row at a cut of 4 with the copying row's gain counted; with fewer left it is
    # due to finish first, and alone its fill pays it up to a cut of 2 (1.44 tokens for
    # 14/12 steps; 1.48 for 16/12 at 3)
    for other_left, want_cut in ((60, 4), (20, 2)):
        spec = Speculator(EngineConfig(speculation="suffix"), cost=CPU)
        copying = row("copy", [5, 6, 7, 8, 9] * 4, 64)
        other = row("other", [1, 2, 3, 4, 100, 101, 102, 1, 2, 3, 4], other_left + 4)
        rows = [copying, other]
        drafts: list[Any] = [(6, 7, 8, 9), ()]
        cut = spec.plan(rows, drafts, [BatchKVCache([0, 0])], None)
        # the other row's fill, looked up 8 long (a verify feeds its first ``cut``)
        assert cut == want_cut
        assert drafts == [(6, 7, 8, 9), (100, 101, 102, 1, 2, 3, 4, 100)]
        rates, lengths = [spec._rate(copying), spec._fills.rate], [4, 8]
        assert rates[1] == pytest.approx(1 / 3)
        own = row_tokens(rates, lengths, cut)
        price = verify_price(rates, lengths, cut, CPU, tokens=sum(own))
        assert spec._price == pytest.approx(price) == pytest.approx((10 + 2 * (1 + cut)) / 12)
        spec.settle(rows)
        gain = [t - 1.0 for t in own]
        if other_left == 60:
            assert spec.credits.balance("copy") == pytest.approx(own[0] + gain[1] / 12 - price)
            assert spec.credits.balance("other") == pytest.approx(
                own[1] + gain[0] / 12 - price)
        else:  # the other row finishes first: nothing of the copying row's gain is its
            assert spec.credits.balance("copy") == pytest.approx(own[0] + gain[1] / 12 - price)
            assert spec.credits.balance("other") == pytest.approx(own[1] - price)


def test_a_row_with_nothing_to_copy_looks_for_drafts_less_often() -> None:
    """No draft EMPTY_RUN steps in a row: the row looks again every EMPTY_SKIP + 1 steps
    (the steps between wait: the batch stays pipelined); a match drafts at once."""
    from types import SimpleNamespace

    from promptcache.engine.speculation.speculator import EMPTY_RUN, EMPTY_SKIP, Speculator
    from promptcache.serving_config import EngineConfig

    spec = Speculator(EngineConfig(speculation="suffix", spec_min_match=2))
    seq = list(range(100, 140))  # no token repeats: nothing to copy
    r = SimpleNamespace(request_id="r", n_prompt=20, output=seq[20:], processors=[],
                        req=SimpleNamespace(tenant="t"))
    r.seq = np.array(seq)
    looked = []
    for step in range(16):
        if not spec.waiting([r]):
            assert spec.propose(r) == ()
            looked.append(step)
    period = EMPTY_SKIP + 1
    assert looked == list(range(EMPTY_RUN)) + list(range(EMPTY_RUN - 1 + period, 16, period))
    # the sequence repeats itself: the next look drafts
    seq += seq[:4]
    r.seq, r.output = np.array(seq), seq[20:]
    while spec.waiting([r]):
        pass
    draft = spec.propose(r)
    assert draft and draft == tuple(seq[4:4 + len(draft)])


def test_a_new_request_starts_at_the_engines_recent_rate_and_probes_until_cut_short(
) -> None:
    """The prior of a new request is the rate of the engine's recent drafts at the fixed
    prior's weight (2 + 1); until one of its drafts is cut short the gate takes it as at
    least PROBE_RATE, then as it is."""
    from types import SimpleNamespace

    from promptcache.engine.speculation.speculator import PROBE_RATE, Speculator
    from promptcache.serving_config import EngineConfig

    recent = Acceptance()
    recent.update(10, 10)  # 0.9 * 2 + 10 accepted, 0.9 * 1 rejected
    prior = recent.prior()
    assert prior.rate == pytest.approx(recent.rate) and prior.updates == 0
    assert prior.accepted + prior.rejected == pytest.approx(3.0)
    spec = Speculator(EngineConfig(speculation="suffix"))
    rows = [SimpleNamespace(request_id=n, usage=SimpleNamespace(spec_drafted=0,
                                                                spec_accepted=0))
            for n in ("a", "b")]
    assert spec._rate(rows[0]) == PROBE_RATE  # prior 2/3, probing: 0.9
    spec.feedback(rows[0], 4, 0)  # a's first draft: all rejected
    assert spec._rate(rows[0]) == pytest.approx(1.8 / 3.7)  # 0.9 * (2, 1) + (0, 1)
    spec.feedback(rows[0], 4, 4)
    # b starts at what a's two drafts left in the engine's counts, probing
    assert spec._recent.rate == pytest.approx((0.81 * 2 + 4) / (0.81 * 2 + 4 + 0.81 * 1 + 0.9))
    assert spec._acceptance(rows[1]).rate == pytest.approx(spec._recent.rate)
    assert spec._rate(rows[1]) == max(PROBE_RATE, spec._recent.rate)
    # c accepts its first draft whole: its counts fall below the probe rate, the gate
    # keeps it there until a draft is cut short
    c = SimpleNamespace(request_id="c", usage=SimpleNamespace(spec_drafted=0,
                                                              spec_accepted=0))
    spec._recent = Acceptance()  # the fixed prior, 2/3
    spec.feedback(c, 2, 2)
    acc = spec._acceptance(c)
    assert acc.rate == pytest.approx(3.8 / 4.7) and acc.cut_short == 0  # 0.81
    assert spec._rate(c) == PROBE_RATE
    spec.feedback(c, 4, 4)
    assert spec._rate(c) == pytest.approx(7.42 / 8.23)  # 0.9016: its own, above
    spec.feedback(c, 4, 1)
    assert acc.cut_short == 1 and acc.updates == 3
    assert spec._rate(c) == pytest.approx(acc.rate) and acc.rate < PROBE_RATE


@pytest.mark.parametrize("max_slowdown", [0.0, 0.25])
def test_a_row_with_nothing_to_copy_is_not_slowed_by_its_batch(tiny_llama_path: Any,
                                                               max_slowdown: float) -> None:
    """Two rows decode together (a verify of k drafts measured at 1 + 0.25 k decode
    steps): one's drafts are right, the other has none (a chat next to an edit). With
    the default bound (0) the copying row verifies only once it decodes alone: no verify
    ever charges the other row. With 0.25 they verify together, and the verifies charge
    the row without drafts at most a quarter of the steps it decodes."""
    prompts, want, eng = two_rows(tiny_llama_path, 21)
    spec = eng._ctx.speculator
    spec.credits = Credits(max_slowdown)
    for width in range(2, 10):  # the cost measured before (a verify's first price is known)
        spec.cost.observe_decode(2, 1.0)
        spec.cost.observe_verify(2, width, 0.0)
    right, chat = prompts
    charged: list[tuple[int, float]] = []  # (rows, price) of each verify
    settle = spec.settle

    def spy(rows: Any) -> None:
        charged.append((len(rows), spec._price))
        settle(rows)

    spec.settle = spy  # type: ignore[method-assign]
    try:
        def source(r: Any, k: int) -> list[int]:
            p = tuple(r.req.prompt_tokens)
            if p == chat:
                return []
            return list(want[p][len(r.output):len(r.output) + k])

        eng._ctx.speculator.source = source
        handles = [eng.submit(GenerationRequest(prompt_tokens=p, sampling=SamplingParams(
            max_tokens=60 if p == right else 24))) for p in prompts]
        got = [h.result(timeout=300) for h in handles]
        assert [g.tokens for g in got] == [want[right], want[chat][:24]]
        assert got[0].usage.spec_accepted == got[0].usage.spec_drafted > 0
        together = [price for rows, price in charged if rows == 2]
        if max_slowdown == 0.0:
            assert together == [] and len(charged) > 0
        else:
            assert together and sum(p - 1.0 for p in together) <= max_slowdown * 24
    finally:
        eng.close()
