"""Constrained decoding inside the batched engine: one request's mask never touches another
request's row.

A Stepper (the scheduler on the test thread, deterministic) runs a batch that mixes
requests under llguidance constraints (JSON Schema, a regex) with unconstrained ones; each
request's tokens equal that request run alone, its pre-processor logits agree within the
batching tolerance, its log-probabilities are those of its own (masked or not)
distribution. Greedy and seeded sampling, the batched path and the per-request path
(caches mlx-lm cannot batch)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

import numpy as np
import pytest
from stepper import Run, Stepper

from promptcache.engine import mlx_compat
from promptcache.engine.api import Constraint
from promptcache.engine.formats import constrained
from promptcache.engine.requests.admission import Ticket
from promptcache.engine.requests.request import Request, validate_request

TOL = 1e-4
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 6},
    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}
JSON = Constraint("json_schema", json.dumps(SCHEMA))
DIGITS = Constraint("regex", "[0-9]{1,200}")
# constrained and unconstrained requests in one batch, interleaved
MIX = (JSON, None, DIGITS, None, JSON)


class ConstrainedStepper(Stepper):
    """The Stepper, with the processors the Engine builds at submit for a constraint."""

    def _make(self, ticket: Ticket) -> Request:
        run: Run = ticket.item
        tokens = validate_request(run.request, self.ctx)
        c = run.request.constraint
        procs = [] if c is None else [
            constrained.logits_processor(c, self.ctx.tokenizer, self.ctx.vocab_size)]
        req = Request(self.ctx, run.request, tokens, run.events.append,
                      cancelled=lambda: run.cancelled, processors=procs, queue_s=ticket.queue_s)
        run.req = req
        return req

    def submit_constrained(self, tokens: list[int], constraint: Constraint | None,
                           max_tokens: int, **sampling: Any) -> Run:
        run = self.submit(tokens, max_tokens, use_cache=False, **sampling)
        # the ticket holds the run: its request is read when the scheduler admits it
        run.request = dataclasses.replace(run.request, constraint=constraint)
        return run


def _prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[900 + i] + [int(t) for t in rng.integers(3, 1000, size=int(rng.integers(6, 40)))]
            for i in range(n)]


def _max_tokens(i: int) -> int:
    return 30 + 5 * i  # rows leave the batch at different steps


def _run(eng: Any, jobs: list[tuple[list[int], Constraint | None, int]], **sampling: Any
         ) -> list[tuple[Run, list[np.ndarray]]]:
    st = ConstrainedStepper(eng)
    runs = [st.submit_constrained(p, c, n, **sampling) for p, c, n in jobs]
    st.run()
    return [(r, eng.recorder.by_request.pop(r.request.request_id)) for r in runs]


def _alone(eng: Any, jobs: list[tuple[list[int], Constraint | None, int]], **sampling: Any
           ) -> list[tuple[Run, list[np.ndarray]]]:
    return [_run(eng, [job], **sampling)[0] for job in jobs]


def _jobs() -> list[tuple[list[int], Constraint | None, int]]:
    return [(p, c, _max_tokens(i)) for i, (p, c) in enumerate(zip(_prompts(len(MIX)), MIX,
                                                                 strict=True))]


def _same(batched: list[tuple[Run, list[np.ndarray]]], alone: list[tuple[Run, list[np.ndarray]]]
          ) -> None:
    for (rb, lb), (ra, la) in zip(batched, alone, strict=True):
        assert rb.result is not None and ra.result is not None
        assert rb.result.finish_reason in ("stop", "length"), rb.result.error
        assert rb.result.tokens == ra.result.tokens
        assert rb.result.text == ra.result.text
        assert len(lb) == len(la)
        assert max(float(np.max(np.abs(x - y))) for x, y in zip(lb, la, strict=True)) <= TOL


def _check_output(run: Run) -> None:
    """A constrained reply that ended by itself matches its constraint."""
    res = run.result
    assert res is not None
    c = run.request.constraint
    if c is None or res.finish_reason != "stop":
        return
    if c is JSON:
        value = json.loads(res.text)
        assert set(value) == {"city", "days"} and 1 <= value["days"] <= 9
        assert isinstance(value["city"], str) and len(value["city"]) <= 6
    else:
        assert re.fullmatch("[0-9]{1,200}", res.text), res.text


@pytest.fixture(scope="module")
def eng(tiny_llama_path: Any, engine_factory: Any) -> Any:
    return engine_factory(tiny_llama_path)


def test_a_mixed_batch_equals_each_request_alone(eng: Any) -> None:
    jobs = _jobs()
    alone = _alone(eng, jobs)
    batched = _run(eng, jobs)
    _same(batched, alone)
    # the masks did something: the constrained replies differ from the free ones
    free = _alone(eng, [(p, None, n) for p, _, n in jobs])
    for (rc, _), (rf, _), c in zip(alone, free, MIX, strict=True):
        assert (rc.result.tokens != rf.result.tokens) == (c is not None)
        _check_output(rc)
    # and at least one constrained reply completed its grammar inside the batch
    assert any(r.result.finish_reason == "stop" for (r, _), c in zip(batched, MIX, strict=True)
               if c is not None)


def test_a_mixed_batch_with_seeded_sampling(eng: Any) -> None:
    jobs = _jobs()
    kw = {"temperature": 1.0, "seed": 11}
    _same(_run(eng, jobs, **kw), _alone(eng, jobs, **kw))


def test_the_per_request_path_too(eng: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = _jobs()
    alone = _alone(eng, jobs)
    monkeypatch.setattr(mlx_compat, "can_batch", lambda caches: False)
    _same(_run(eng, jobs), alone)


def test_logprobs_are_each_rows_own_distribution(eng: Any) -> None:
    """Under a digits-only regex every alternative is a digit string (or EOS, once
    allowed); the unconstrained neighbour's alternatives are anything, as alone."""
    tok = eng.tokenizer
    jobs = [(p, c, 12) for p, c in zip(_prompts(2), (DIGITS, None), strict=True)]
    batched = _run(eng, jobs, logprobs=5)
    alone = _alone(eng, jobs, logprobs=5)
    eos = set(tok.eos_token_ids)
    free_alts: set[int] = set()
    for k, ((rb, _), (ra, _)) in enumerate(zip(batched, alone, strict=True)):
        evb = [e for e in rb.events if hasattr(e, "logprob")]
        eva = [e for e in ra.events if hasattr(e, "logprob")]
        assert [e.token_id for e in evb] == [e.token_id for e in eva] and evb
        for b, a in zip(evb, eva, strict=True):
            assert b.logprob is not None and a.logprob is not None
            assert math.isclose(b.logprob, a.logprob, abs_tol=TOL)
            assert [t for t, _ in b.top_logprobs] == [t for t, _ in a.top_logprobs]
            assert len(b.top_logprobs) == 5
            for (_, x), (_, y) in zip(b.top_logprobs, a.top_logprobs, strict=True):
                assert math.isclose(x, y, abs_tol=TOL) and math.isfinite(x)
            ids = [t for t, _ in b.top_logprobs]
            if k == 0:
                assert all(t in eos or re.fullmatch("[0-9]+", tok.decode([t])) for t in ids)
            else:
                free_alts |= set(ids)
    # unconstrained: the alternatives are not all digits
    assert any(not re.fullmatch("[0-9]+", tok.decode([t])) for t in free_alts)
