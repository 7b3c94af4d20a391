"""Speculation's whole-step guard (``StepGuard``, engine/speculation/cost.py): per batch
size, verify steps that deliver fewer tokens per second than decode steps turn
speculation off for a while. Decisions from scripted seconds, never from timing."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import counts, speculating

from promptcache.engine.api import GenerationRequest, SamplingParams
from promptcache.engine.speculation.cost import (
    FREE,
    GATED_OFF_STEPS,
    MAX_GATED_OFF_STEPS,
    MAX_IDLE_OFF_STEPS,
    MAX_OFF_STEPS,
    OFF_STEPS,
    SLACK,
    WINDOW,
    OnlineCost,
    StepGuard,
)


def steps_off(guard: StepGuard, rows: int) -> int:
    """How many steps in a row ``rows`` rows may not speculate (consumes them)."""
    n = 0
    while not guard.allows(rows):
        n += 1
    return n


def test_a_losing_window_turns_its_batch_size_off() -> None:
    # a decode step of any size: 1 s, `rows` tokens
    guard = StepGuard(lambda rows, context: 1.0)
    for _ in range(WINDOW - 1):  # 7 tokens per second against decoding's 8
        guard.observe_step(8, 7, 1.0)
        assert guard.allows(8)  # not judged before a whole window
    guard.observe_step(8, 7, 1.0)
    assert guard.turned_off == 1 and guard.paused() == {8: OFF_STEPS}
    assert guard.allows(4) and guard.allows(1)  # other sizes keep speculating
    assert steps_off(guard, 8) == OFF_STEPS
    assert guard.allows(8) and guard.paused() == {}


def test_failed_probes_double_the_pause_and_a_paying_window_resets_it() -> None:
    guard = StepGuard(lambda rows, context: 2.0)  # decoding: rows / 2 tokens per second
    for _ in range(8):
        for _ in range(WINDOW):
            guard.observe_step(2, 1, 1.0)  # 1 token/s: exactly decoding's rate
        assert guard.paused() == {}
        for _ in range(WINDOW):
            guard.observe_step(2, 1, 1.1)  # 0.91 of decoding's rate
        assert steps_off(guard, 2) == OFF_STEPS  # the paying window reset the pause
    want = 2 * OFF_STEPS  # the last pause was OFF_STEPS: the next probe that loses doubles it
    for _ in range(8):
        for _ in range(WINDOW):
            guard.observe_step(2, 1, 1.1)
        assert steps_off(guard, 2) == want
        want = min(MAX_OFF_STEPS, 2 * want)
    assert want == MAX_OFF_STEPS and guard.turned_off == 16


def test_the_slack_and_the_window_sum() -> None:
    guard = StepGuard(lambda rows, context: 1.0)
    # just over (1 - SLACK) of decoding's rate over the window as a whole: allowed
    tokens = [10, 10, 10, 10]
    seconds = [1.0, 1.0, 1.0, 0.999 * 4 / (1 - SLACK) - 3.0]
    for t, s in zip(tokens, seconds, strict=True):
        guard.observe_step(10, t, s)
    assert guard.paused() == {}
    for t, s in zip(tokens, [x * 1.01 for x in seconds], strict=True):
        guard.observe_step(10, t, s)
    assert guard.paused() == {10: OFF_STEPS}
    guard.observe_step(3, 5, 0.0)  # no time: ignored
    guard.observe_step(0, 5, 1.0)
    assert guard.paused() == {10: OFF_STEPS}


class ScriptedSteps(OnlineCost):
    """Decode steps take 1 s, a verify forward 1 s, a whole verify step ``step_s``."""

    def __init__(self, step_s: float) -> None:
        super().__init__(FREE)
        self.step_s = step_s

    def observe_decode(self, rows: int, seconds: float, context: int = 0) -> None:
        super().observe_decode(rows, 1.0)

    def observe_verify(self, rows: int, width: int, seconds: float, context: int = 0
                       ) -> None:
        super().observe_verify(rows, width, 1.0)

    def observe_step(self, rows: int, width: int, tokens: int, seconds: float,
                     context: int = 0) -> None:
        super().observe_step(rows, width, tokens, self.step_s)


@pytest.mark.parametrize("step_s", [100.0, 1.0])
def test_the_engine_stops_speculating_when_whole_steps_lose(tiny_llama_path: Any,
                                                           step_s: float) -> None:
    """Right drafts (every token accepted): the gate says verify. A whole verify step
    scripted at 100 s loses to decoding (1 s a token): after WINDOW verifies the batch
    size is off for OFF_STEPS steps, which decode the rest of the reply; at 1 s a step
    the verifies pay and go on. The tokens are those of decoding one at a time."""
    toks, want, eng = speculating(tiny_llama_path, 5, 40, 4, ScriptedSteps(step_s))
    try:
        spec = eng._ctx.speculator
        spec.source = lambda r, k: want[len(r.output):len(r.output) + k]
        got = eng.submit(GenerationRequest(prompt_tokens=toks, sampling=SamplingParams(
            max_tokens=60))).result(timeout=300)
        assert got.tokens == want
        c = counts(eng._ctx)
        assert c.spec_accepted == c.spec_drafted
        if step_s > 1.0:
            # the first token from the prefill; 4 verifies of 2 + 4 + 4 + 4 drafts give
            # 18 tokens, then OFF_STEPS decode steps 32, and the probe's 2 verifies of 4
            # drafts the last 9 (the reply ends before the probe's window is whole)
            assert (c.spec_verifies, c.spec_drafted, c.spec_guard_off) == (WINDOW + 2, 22, 1)
            assert c.decode_steps - c.spec_verifies >= OFF_STEPS  # plain steps
        else:
            assert c.spec_guard_off == 0 and c.spec_verifies > WINDOW
            assert c.decode_steps < 60 // 2
    finally:
        eng.close()


def test_gated_steps_in_a_row_pause_the_size_and_a_verify_resets_it() -> None:
    guard = StepGuard(lambda rows, context: 1.0)
    guard.observe_gated(8)
    assert guard.paused() == {}  # one gated step: nothing yet
    guard.observe_gated(8)
    assert guard.paused() == {8: GATED_OFF_STEPS} and guard.gated_off == 1
    assert steps_off(guard, 8) == GATED_OFF_STEPS
    want = 2 * GATED_OFF_STEPS
    for _ in range(6):  # each probe gated twice again: the pause doubles, up to the cap
        guard.observe_gated(8)
        guard.observe_gated(8)
        assert steps_off(guard, 8) == want
        want = min(MAX_GATED_OFF_STEPS, 2 * want)
    assert want == MAX_GATED_OFF_STEPS
    guard.observe_step(8, 16, 1.0)  # a verify (that pays) resets the run and the pause
    guard.observe_gated(8)
    guard.observe_gated(8)
    assert steps_off(guard, 8) == GATED_OFF_STEPS
    assert guard.allows(4) and guard.turned_off == 0


def test_steps_with_no_draft_pause_the_size_up_to_the_idle_cap() -> None:
    cost = OnlineCost(FREE)
    want = GATED_OFF_STEPS
    for _ in range(5):
        cost.observe_gated(2, idle=True)
        cost.observe_gated(2, idle=True)
        assert steps_off(cost.guard, 2) == want
        want = min(MAX_IDLE_OFF_STEPS, 2 * want)
    assert want == MAX_IDLE_OFF_STEPS == 16
    cost.observe_gated(2)  # drafts the gate did not take: the longer cap
    cost.observe_gated(2)
    assert steps_off(cost.guard, 2) == 2 * MAX_IDLE_OFF_STEPS
