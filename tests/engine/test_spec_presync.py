"""The gate before the sync (``Speculator.presync``): a step whose rows' drafts would not
pay decodes pipelined, without reading its pending tokens first. Decisions from the
rows' sequences and scripted costs, never from timing."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from promptcache.engine.speculation.cost import FREE, OnlineCost, VerifyCost
from promptcache.engine.speculation.speculator import PROBE_STEPS, Speculator
from promptcache.serving_config import EngineConfig

X = list(range(100, 130))  # 30 tokens, none repeated


def row(seq: list[int], n_prompt: int = 20, rid: str = "r") -> Any:
    r = SimpleNamespace(request_id=rid, n_prompt=n_prompt, output=seq[n_prompt:],
                        processors=[], pos=len(seq) - 1,
                        req=SimpleNamespace(tenant="t", sampling=SimpleNamespace(max_tokens=64)),
                        usage=SimpleNamespace(spec_drafted=0, spec_accepted=0))
    r.seq = np.array(seq)
    return r


def speculator(cost: Any) -> Speculator:
    return Speculator(EngineConfig(speculation="suffix", spec_min_match=2), cost=cost)


def test_the_draft_ahead_starts_after_the_pending_token() -> None:
    spec = speculator(OnlineCost(FREE))
    r = row(X + X[:5])  # the sequence repeats: the pending token would be X[5]
    assert spec._ahead(r, 3) == tuple(X[6:9])
    # a row that just joined: its pending token (the prefill's) is in its output already
    assert spec._ahead(r, 3, ahead=False) == tuple(X[5:8])
    assert spec.propose(r)[:3] == tuple(X[5:8])  # the draft after the sequence itself


def test_a_repeating_sequence_syncs_and_nothing_is_counted() -> None:
    spec = speculator(OnlineCost(FREE))  # a verify costs a decode step: drafts pay
    r = row(X + X[:5])
    assert spec.presync([r], [], None, [False])
    c = spec.counters
    assert (c.spec_presync_gated, c.spec_gated, c.spec_paused) == (0, 0, 0)
    assert all(st.pause == (0, 0) for st in spec._state.values()) and spec.cost.guard.paused() == {}


def test_nothing_to_copy_decodes_pipelined_and_counts_the_rows_cool_down() -> None:
    spec = speculator(OnlineCost(FREE))
    cooling, fresh = row(X + X[:5], rid="cooling"), row(X, rid="fresh")
    spec.row("cooling").cool = (2, 2)  # its draft would pay, but it cools down
    assert not spec.presync([cooling, fresh], [], None, [False, False])
    c = spec.counters
    assert (c.spec_presync_gated, c.spec_gated, c.spec_paused) == (1, 0, 0)
    assert spec.row("cooling").cool == (1, 2)  # the step counted for its cool-down
    assert spec.cost.guard.paused() == {}  # the guard saw no gated step


def test_drafts_that_do_not_pay_pause_their_row_without_a_sync() -> None:
    # a verify of k drafts costs 1 + k decode steps: no draft pays
    spec = speculator(OnlineCost(VerifyCost(0.0, 1.0)))
    r = row(X + X[:5])
    for _ in range(3):  # one decline pauses the row; while paused it waits
        assert not spec.presync([r], [], None, [False])
    c = spec.counters
    assert (c.spec_presync_gated, c.spec_gated, c.spec_paused) == (3, 0, 1)
    assert spec.row("r").pause == (PROBE_STEPS - 2, PROBE_STEPS)
    assert spec.cost.guard.paused() == {}


def test_a_draft_source_always_syncs_and_a_fixed_cost_gates_the_same() -> None:
    r = row(X)  # nothing to copy
    spec = speculator(OnlineCost(FREE))
    spec.source = lambda req, k: ()  # tests' drafts: asked after the sync
    assert spec.presync([r], [], None, [False])
    assert spec.counters.spec_presync_gated == 0
    fixed = speculator(FREE)  # the operator's fixed cost: the same gate before the sync
    assert not fixed.presync([r], [], None, [False])
    assert fixed.presync([row(X + X[:5])], [], None, [False])
    assert fixed.counters.spec_presync_gated == 1


def test_a_pause_that_ends_on_a_declined_step_still_probes() -> None:
    """A row's pause ends on a step declined before the sync (it drafted nothing: it was
    waiting): its probe is not spent there, so its next draft is judged at the probe's
    optimistic rate. Before, the decline spent every row's probe, and a row whose own
    rate does not pay paused again, twice as long, without ever probing."""
    from promptcache.engine.speculation.gate import Acceptance

    # a verify of k drafts costs (3 + k) / 3 decode steps: at the probe's rate (0.9) one
    # draft token pays, at the row's own rate (0.3) none does
    spec = speculator(OnlineCost(VerifyCost(2.0, 1.0)))
    r = row(X + X[:5])
    acc = spec.row("r").acc = Acceptance(0.3, 0.7)
    acc.updates = acc.cut_short = 3
    spec.row("r").pause = (1, PROBE_STEPS)  # the last step of its pause
    assert not spec.presync([r], [], None, [False])  # waiting: nothing drafted
    assert spec.row("r").pause == (0, PROBE_STEPS) and spec.row("r").probing
    assert spec.presync([r], [], None, [False])  # the probe: verified
    assert spec.counters.spec_paused == 0
    # without the probe the same draft is declined and the row pauses twice as long
    spec.row("r").probing = False
    assert not spec.presync([r], [], None, [False])
    assert spec.row("r").pause == (2 * PROBE_STEPS, 2 * PROBE_STEPS)
