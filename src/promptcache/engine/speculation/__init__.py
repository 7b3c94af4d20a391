"""Speculative decoding, the engine's one door to it: a ``Speculator`` built from the
config (``make_speculator``), the decode batch's two calls (``plan_verify``, then
``apply_verify`` with the forward's logits) and its stats (``spec_stats``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ...serving_config import EngineConfig
from ..steps import Steps, no_steps
from .cost import cost_from_config
from .speculator import Speculator
from .state import SpecCounters
from .verify import VerifyPlan, apply_verify, plan_verify

__all__ = ["Speculator", "VerifyPlan", "apply_verify", "make_speculator", "plan_verify",
           "spec_stats"]


def make_speculator(config: EngineConfig, model: Any, vocab_size: int,
                    history: Callable[[str], Sequence[Sequence[int]]] | None = None, *,
                    steps: Steps = no_steps) -> Speculator | None:
    """``--speculation suffix``: a speculator whose verify cost is ``spec_verify_cost``
    (measured on ``model`` by default) and whose tenant pools are seeded from
    ``history``; None when speculation is off."""
    if config.speculation != "suffix":
        return None
    return Speculator(config, history=history, cost=cost_from_config(
        config.spec_verify_cost, model, vocab_size, steps=steps))


def spec_stats(spec: Speculator | None) -> dict[str, Any]:
    """The counters, the draft pool's size, acceptance rate (accepted / drafted), mean
    accepted length (accepted / verify forwards) and tokens per verify forward."""
    c = spec.counters if spec is not None else SpecCounters()
    v, d, a = c.spec_verifies, c.spec_drafted, c.spec_accepted
    relative = ({f"k{k}": round(spec.cost.relative(1, k + 1), 3) for k in (1, 2, 4, 8, 16)}
                if spec is not None else {})
    return {**c.__dict__,
            "spec_pool_tokens": spec.pools.num_tokens() if spec is not None else 0,
            # one stream's verify forward of k drafts, in decode steps
            "spec_verify_cost": relative,
            "spec_pool_ngrams": spec.pools.num_ngrams() if spec is not None else 0,
            "spec_acceptance_rate": round(a / d, 4) if d else None,
            "spec_mean_accepted": round(a / v, 4) if v else None,
            "spec_tokens_per_forward": round(1 + a / v, 4) if v else None}

