"""When a verify forward pays: the measured cost of a wider forward and each row's
acceptance (speculative decoding's gate, ``Speculator.plan``).

A forward over ``rows`` rows of ``width`` positions costs about ``overhead + per_token
* rows * width`` (``VerifyCost``: weights read once per forward, then work per position).
``measure_verify_cost`` fits the two numbers from forwards of width 1 and 16 on the
model itself at startup (a few forwards on an empty cache, the fastest of three each).
A normal decode step is the same forward at width 1 and gives every row one token.

A row's drafts are accepted token by token with probability ``q`` (``Acceptance``:
decayed counts of accepted tokens and of rejections, a prior of 2 and 1), so a
draft truncated to ``L`` tokens is worth ``1 + q + q^2 + ... + q^L`` tokens. For each
``L`` from 1 to the longest draft the gate compares the tokens a verify of width
``1 + L`` is expected to give with its cost (plus, for array states, the forward that
feeds the kept positions again when some row rejects), and speculates only when the
best ``L`` beats decoding by ``MARGIN``: a batch with nothing to copy decodes as
without speculation. Pure arithmetic; timing only in ``measure_verify_cost``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

logger = logging.getLogger(__name__)

# a verify must be expected to beat decoding by this fraction
MARGIN = 0.05
# how much of a row's acceptance history each new verify keeps
DECAY = 0.9
MEASURE_WIDTH = 16
PRIOR_ACCEPTED = 2.0
PRIOR_REJECTED = 1.0


@dataclass(frozen=True)
class VerifyCost:
    """A forward costs ``overhead + per_token * rows * width`` (any unit)."""

    overhead: float
    per_token: float

    def __post_init__(self) -> None:
        if self.overhead < 0 or self.per_token < 0 or self.overhead + self.per_token <= 0:
            raise ValueError(f"need overhead, per_token >= 0, not both 0: {self}")

    def relative(self, rows: int, width: int) -> float:
        """A forward of ``width`` positions per row, in decode steps (width 1)."""
        return (self.overhead + self.per_token * rows * width) \
            / (self.overhead + self.per_token * rows)


FREE = VerifyCost(1.0, 0.0)  # a verify costs what a decode step does (tests)


def measure_verify_cost(model: Any, vocab_size: int, repeats: int = 3) -> VerifyCost:
    """Fit ``VerifyCost`` from forwards of width 1 and ``MEASURE_WIDTH`` on empty caches
    (the fastest of ``repeats`` each, after one warm-up)."""
    def once(width: int) -> float:
        x = mx.array([[i % max(1, vocab_size - 1) + 1 for i in range(width)]], dtype=mx.uint32)
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        mx.eval(model(x, cache=cache))
        return time.perf_counter() - t0

    once(1)
    once(MEASURE_WIDTH)
    t1 = tw = 0.0
    for _ in range(3):  # a wider forward is never cheaper: on a noisy machine, measure again
        t1 = min(once(1) for _ in range(repeats))
        tw = min(once(MEASURE_WIDTH) for _ in range(repeats))
        if tw > t1:
            break
    if tw <= t1:  # still noise: assume a 16-wide forward costs two narrow ones, not one
        logger.warning("verify cost: a %d-token forward measured no slower than a 1-token "
                       "one (%.1f vs %.1f ms): assuming twice", MEASURE_WIDTH, tw * 1e3, t1 * 1e3)
        tw = 2 * t1
    per_token = (tw - t1) / (MEASURE_WIDTH - 1)
    overhead = max(t1 - per_token, 1e-3 * t1, 1e-9)
    return VerifyCost(overhead, per_token)


class Acceptance:
    """One request's decayed counts: draft tokens accepted, drafts cut short."""

    __slots__ = ("accepted", "rejected")

    def __init__(self) -> None:
        # the prior decays with the counts: what a request's drafts do wins
        self.accepted = PRIOR_ACCEPTED
        self.rejected = PRIOR_REJECTED

    def update(self, drafted: int, accepted: int) -> None:
        self.accepted = DECAY * self.accepted + accepted
        self.rejected = DECAY * self.rejected + (1.0 if accepted < drafted else 0.0)

    @property
    def rate(self) -> float:
        """The chance that the next draft token is accepted. Prior: 2 accepted, 1
        rejected (2/3): a draft exists only where the sequence's last tokens occurred
        before, which is evidence for the tokens that followed."""
        return self.accepted / (self.accepted + self.rejected)


def expected_tokens(rate: float, n: int) -> float:
    """Tokens a row gets from a verify of a draft of ``n`` tokens: its own token plus
    each draft token while every one before it was accepted."""
    return 1.0 + sum(rate ** j for j in range(1, n + 1))


def plan(rates: Sequence[float], lengths: Sequence[int], cost: VerifyCost, *,
         state: bool = False, uniform: bool = False) -> int:
    """How many draft tokens each row keeps (its draft cut to that), 0 for no verify.

    ``rates``: each row's acceptance rate; ``lengths``: its draft's length; ``state``:
    array states, fed the kept positions again when a row rejects part of its draft;
    ``uniform``: every row keeps as many positions as the shortest."""
    rows = len(rates)
    best, best_gain = 0, 1.0 + MARGIN
    for cut in range(1, max(lengths, default=0) + 1):
        per_row = [expected_tokens(q, min(n, cut)) for q, n in zip(rates, lengths, strict=True)]
        tokens = rows * min(per_row) if uniform else sum(per_row)
        price = cost.relative(rows, 1 + cut)
        if state:
            whole = 1.0
            for q, n in zip(rates, lengths, strict=True):
                whole *= q ** cut if n >= cut else 0.0  # a shorter row is padded
            price += (1.0 - whole) * cost.relative(rows, round(tokens / rows))
        gain = tokens / (rows * price)
        if gain > best_gain:
            best, best_gain = cut, gain
    return best
