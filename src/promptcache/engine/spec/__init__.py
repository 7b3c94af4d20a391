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
from .state import spec_stats
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
