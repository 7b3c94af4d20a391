"""When a verify forward pays: the measured cost of a wider forward and each row's
acceptance (speculative decoding's gate, ``Speculator.plan``).

A forward over ``rows`` rows of ``width`` positions costs about ``overhead + per_token
* rows * width`` (``VerifyCost``: weights read once per forward, then work per position).
``measure_verify_cost`` fits them (and ``wide``, what any forward of several positions
adds) from forwards of width 1, 2 and 16 over a 1024-token context on the model itself
at startup (the fastest of three each).
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
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

logger = logging.getLogger(__name__)

# a verify must be expected to beat decoding by this fraction
MARGIN = 0.05
# how much of a row's acceptance history each new verify keeps
DECAY = 0.9
MEASURE_WIDTH = 16
# tokens in the cache the verify cost is measured over
MEASURE_CONTEXT = 1024
PRIOR_ACCEPTED = 2.0
PRIOR_REJECTED = 1.0


@dataclass(frozen=True)
class VerifyCost:
    """A forward costs ``overhead + per_token * rows * width`` (any unit), plus ``wide``
    when ``width > 1`` (several positions per row take another path than one: the
    causal mask over the context, matrix instead of vector attention kernels)."""

    overhead: float
    per_token: float
    wide: float = 0.0

    def __post_init__(self) -> None:
        if (self.overhead < 0 or self.per_token < 0 or self.wide < 0
                or self.overhead + self.per_token <= 0):
            raise ValueError(f"need overhead, per_token, wide >= 0, not all 0: {self}")

    def relative(self, rows: int, width: int) -> float:
        """A forward of ``width`` positions per row, in decode steps (width 1)."""
        extra = self.wide if width > 1 else 0.0
        return (self.overhead + self.per_token * rows * width + extra) \
            / (self.overhead + self.per_token * rows)


FREE = VerifyCost(1.0, 0.0)  # a verify costs what a decode step does (tests)


def measure_verify_cost(model: Any, vocab_size: int, repeats: int = 3) -> VerifyCost:
    """Fit ``VerifyCost`` from forwards of width 1, 2 and ``MEASURE_WIDTH`` over a cache
    holding ``MEASURE_CONTEXT`` tokens (attention over a context is part of a verify's
    cost; a cache that cannot be trimmed back is measured empty), the fastest of
    ``repeats`` each after one warm-up."""
    base = make_prompt_cache(model)
    context = MEASURE_CONTEXT if can_trim_prompt_cache(base) else 0
    if context:
        mx.eval(model(_tokens(context, vocab_size), cache=base))

    def once(width: int) -> float:
        cache = base if context else make_prompt_cache(model)
        x = _tokens(width, vocab_size)
        t0 = time.perf_counter()
        mx.eval(model(x, cache=cache))
        took = time.perf_counter() - t0
        if context:
            trim_prompt_cache(cache, width)
        return took

    for w in (1, 2, MEASURE_WIDTH):
        once(w)
    t1 = t2 = tw = 0.0
    for _ in range(3):  # a wider forward is never cheaper: on a noisy machine, measure again
        t1 = min(once(1) for _ in range(repeats))
        t2 = min(once(2) for _ in range(repeats))
        tw = min(once(MEASURE_WIDTH) for _ in range(repeats))
        if tw > t2 >= t1:
            break
    if not tw > t2:  # still noise: assume a 16-wide forward costs two narrow ones, not one
        logger.warning("verify cost: a %d-token forward measured no slower than a 2-token "
                       "one (%.1f vs %.1f ms): assuming twice", MEASURE_WIDTH, tw * 1e3, t2 * 1e3)
        t2 = max(t2, t1)
        tw = 2 * t2
    per_token = (tw - t2) / (MEASURE_WIDTH - 2)
    overhead = max(t1 - per_token, 1e-3 * t1, 1e-9)
    wide = max(0.0, t2 - (overhead + 2 * per_token))
    return VerifyCost(overhead, per_token, wide)


def _tokens(n: int, vocab_size: int) -> mx.array:
    return mx.array([[i % max(1, vocab_size - 1) + 1 for i in range(n)]], dtype=mx.uint32)


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
