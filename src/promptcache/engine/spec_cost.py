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

The startup fit is taken on an idle model over one context length; while serving, the
verify forward can cost more (measured on a loaded CPU: 1.5-4.2 decode steps where the
fit said 1.09-1.85). ``OnlineCost`` corrects it: the decode batch reports the wall time
of each verify forward and of each plain decode step (``observe_verify`` /
``observe_decode``, taken at the syncs the steps already do), and per draft-length bucket
(k = 1, 2, 3-4, 5-8, 9-16, ...) a running ratio of measured to fitted cost (the mean of
the first samples, then exponentially weighted) replaces the fit as samples arrive, the
fit counted as ``FIT_WEIGHT`` samples of ratio 1 (a bucket without samples takes its
nearest measured neighbour's ratio). So one verify that ran slow (the CPU busy with
other work) moves a bucket's price a quarter of the way, not all of it: priced too high,
the gate would stop verifying and never time a verify again to learn otherwise.

A verify is compared with plain decode steps over the same context: a step attends to
every token in the cache, so one over 2,000 tokens takes twice one over a few (SmolLM2
on this CPU), and a verify divided by steps timed on another conversation would be
priced wrong by as much (the first verify of a long prompt after a short warm-up
request: 2.5 decode steps for k=1, and its row paused). The plain steps are kept per
batch size and context octave (``context_bucket``: below 256 tokens, 256-511, 512-1023,
...), each as a ratio to the fit's step over its own context (``VerifyCost.step``: the
startup fit also times a step over an empty cache, which gives what each token of
context adds), so a size and octave not timed yet takes the nearest timed one's ratio at
its own context. ``--spec-verify-cost`` fixes the cost instead
(``TableCost``: one number, the cost per extra position in decode steps, or a list of
costs at k = 1, 2, ...), with no correction.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from .spec_guard import MAX_GATED_OFF_STEPS, MAX_IDLE_OFF_STEPS, StepGuard
from .steps import Steps, no_steps

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
# OnlineCost: the weight of a new sample in the running estimates
ALPHA = 0.2
# ... and of the startup fit in a draft-length bucket's correction, in samples: one
# verify timed during other work does not reprice every later one by itself
FIT_WEIGHT = 3.0
# a sample this many times the running estimate is an outlier (the engine did other
# work in between: a prefill chunk, a request joining) ...
OUTLIER = 4.0
# ... unless this many come in a row (the machine did get slower)
OUTLIERS_IN_A_ROW = 8


class CostModel(Protocol):
    def relative(self, rows: int, width: int) -> float:
        """A forward of ``width`` positions per row over ``rows`` rows, in decode steps
        (the same rows at width 1)."""
        ...


@dataclass(frozen=True)
class VerifyCost:
    """A forward costs ``overhead + per_token * rows * width`` (any unit), plus ``wide``
    when ``width > 1`` (several positions per row take another path than one: the
    causal mask over the context, matrix instead of vector attention kernels), over a
    context of ``at`` tokens; a decode step costs ``attend`` more per row for each token
    of context beyond ``at`` (``step``)."""

    overhead: float
    per_token: float
    wide: float = 0.0
    attend: float = 0.0
    at: int = 0

    def __post_init__(self) -> None:
        if (self.overhead < 0 or self.per_token < 0 or self.wide < 0 or self.attend < 0
                or self.at < 0 or self.overhead + self.per_token <= 0):
            raise ValueError(f"need overhead, per_token, wide, attend, at >= 0, "
                             f"overhead + per_token > 0: {self}")

    def step(self, rows: int, context: int = 0) -> float:
        """A decode step (width 1) of ``rows`` rows over ``context`` tokens (``at``
        without ``attend``); never below ``overhead`` (nor 0)."""
        t = self.overhead + self.per_token * rows + self.attend * rows * (context - self.at)
        return max(t, self.overhead, 1e-3 * (self.overhead + self.per_token * rows))

    def relative(self, rows: int, width: int) -> float:
        """A forward of ``width`` positions per row, in decode steps (width 1)."""
        extra = self.wide if width > 1 else 0.0
        return (self.overhead + self.per_token * rows * width + extra) \
            / (self.overhead + self.per_token * rows)


FREE = VerifyCost(1.0, 0.0)  # a verify costs what a decode step does (tests)


@dataclass(frozen=True)
class TableCost:
    """Fixed costs, in decode steps, of a verify of k = 1, 2, ... draft tokens
    (``--spec-verify-cost``); past the table's end, the last step's slope continues
    (one entry ``c``: slope ``c - 1``)."""

    steps: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.steps or any(not math.isfinite(c) or c <= 0 for c in self.steps):
            raise ValueError(f"need verify costs > 0, got {self.steps}")

    @classmethod
    def per_position(cls, extra: float) -> TableCost:
        """A verify of k drafts costs ``1 + extra * k`` decode steps."""
        return cls((1.0 + extra,))

    def relative(self, rows: int, width: int) -> float:
        k = width - 1
        if k <= 0:
            return 1.0
        s = self.steps
        if k <= len(s):
            return s[k - 1]
        slope = s[-1] - s[-2] if len(s) > 1 else s[0] - 1.0
        return s[-1] + max(0.0, slope) * (k - len(s))


def bucket(k: int) -> int:
    """Draft lengths measured together: 1, 2, 3-4, 5-8, 9-16, ... -> 0, 1, 2, 3, 4, ..."""
    return max(0, k - 1).bit_length()


def context_bucket(tokens: int) -> int:
    """Contexts whose decode steps are timed together: below 256 tokens, 256-511,
    512-1023, 1024-2047, ... -> 0, 1, 2, 3, ..."""
    return (max(0, tokens) >> 8).bit_length()


class _Ewma:
    """A running estimate (the mean of the first samples, then exponentially weighted by
    ``ALPHA``) that skips outliers (``OUTLIER`` x the estimate) unless
    ``OUTLIERS_IN_A_ROW`` of them arrive in a row."""

    __slots__ = ("value", "samples", "_outliers")

    def __init__(self, first: float) -> None:
        self.value = first
        self.samples = 1
        self._outliers = 0

    def add(self, x: float) -> None:
        if x > OUTLIER * self.value:
            self._outliers += 1
            if self._outliers < OUTLIERS_IN_A_ROW:
                return
        self._outliers = 0
        self.samples += 1
        # the mean of the first 1 / ALPHA samples (one odd first sample is soon
        # outweighed), then exponentially weighted
        self.value += max(ALPHA, 1.0 / self.samples) * (x - self.value)


class OnlineCost:
    """``prior`` (the startup fit, in seconds when measured) corrected by the wall time
    of the verify forwards and decode steps the engine runs (see the module docstring).
    ``context``: the tokens in the batch's caches (its longest row's). Engine thread
    only."""

    def __init__(self, prior: VerifyCost) -> None:
        self.prior = prior
        # (rows, context_bucket) -> a plain decode step over the fit's step there
        self._decode: dict[tuple[int, int], _Ewma] = {}
        self._ratio: dict[int, _Ewma] = {}  # k bucket -> measured / fitted relative cost
        self.verify_samples = 0
        self.decode_samples = 0
        # whole verify steps against plain decode steps, per batch size
        self.guard = StepGuard(self.decode_seconds)

    def allows(self, rows: int) -> bool:
        """Whether a batch of ``rows`` rows may speculate this step (``StepGuard``)."""
        return self.guard.allows(rows)

    def observe_step(self, rows: int, width: int, tokens: int, seconds: float,
                     context: int = 0) -> None:
        """A whole verify step (drafting to repaired caches) of ``rows`` x ``width``
        gave ``tokens`` tokens in ``seconds`` (``StepGuard``)."""
        self.guard.observe_step(rows, tokens, seconds, context)

    def observe_gated(self, rows: int, *, idle: bool = False) -> None:
        """A step of ``rows`` rows had drafts the gate did not verify, or (``idle``) no
        row found one (``StepGuard``)."""
        self.guard.observe_gated(rows, cap=MAX_IDLE_OFF_STEPS if idle else MAX_GATED_OFF_STEPS)

    def decode_seconds(self, rows: int, context: int = 0) -> float:
        """A plain decode step of ``rows`` rows over ``context`` tokens: the fit's step
        there (``VerifyCost.step``) times the ratio measured at this size and context
        octave, else at the nearest measured one (the same octave first, then the
        nearest size), else the fit itself (seconds when measured at startup)."""
        fit = self.prior.step(rows, context)
        if not self._decode:
            return fit
        key = (rows, context_bucket(context))
        est = self._decode.get(key)
        if est is None:
            est = self._decode[min(self._decode, key=lambda n: (
                abs(n[1] - key[1]), abs(n[0] - rows), n))]
        return est.value * fit

    def observe_decode(self, rows: int, seconds: float, context: int = 0) -> None:
        if seconds <= 0:
            return
        self.decode_samples += 1
        ratio = seconds / self.prior.step(rows, context)
        key = (rows, context_bucket(context))
        est = self._decode.get(key)
        if est is None:
            self._decode[key] = _Ewma(ratio)
        else:
            est.add(ratio)

    def observe_verify(self, rows: int, width: int, seconds: float, context: int = 0
                       ) -> None:
        """A verify forward of ``rows`` x ``width`` over ``context`` tokens took
        ``seconds`` (from the sync that made the previous step's tokens known to the one
        that reads its own)."""
        if width <= 1 or seconds <= 0:
            return
        self.verify_samples += 1
        ratio = seconds / self.decode_seconds(rows, context) \
            / self.prior.relative(rows, width)
        b = bucket(width - 1)
        est = self._ratio.get(b)
        if est is None:
            self._ratio[b] = _Ewma(ratio)
        else:
            est.add(ratio)

    def correction(self, k: int) -> float:
        """Measured over fitted cost for drafts of ``k`` tokens: the bucket's running
        ratio weighed against the fit (1.0) as ``FIT_WEIGHT`` samples, so a bucket's first
        verifies move it part of the way (1.0: no samples yet)."""
        if not self._ratio:
            return 1.0
        b = bucket(k)
        est = self._ratio.get(b)
        if est is None:
            est = self._ratio[min(self._ratio, key=lambda n: (abs(n - b), n))]
        return (FIT_WEIGHT + est.samples * est.value) / (FIT_WEIGHT + est.samples)

    def relative(self, rows: int, width: int) -> float:
        if width <= 1:
            return 1.0
        return max(1.0, self.prior.relative(rows, width) * self.correction(width - 1))


def cost_from_config(setting: str | tuple[float, float] | None, model: Any,
                     vocab_size: int, *, steps: Steps = no_steps) -> CostModel:
    """``EngineConfig.spec_verify_cost`` -> the gate's cost: ``(overhead, per_token)``
    fixed; a number or a list (``--spec-verify-cost``) fixed; ``auto`` / None: measured
    at startup, corrected online (``OnlineCost``)."""
    from ..serving_config import verify_cost_steps

    if isinstance(setting, tuple):
        return VerifyCost(*setting)
    table = verify_cost_steps(setting)
    if table is not None:
        return TableCost(table)
    with steps("measuring the speculation cost"):
        cost = measure_verify_cost(model, vocab_size)
    logger.info("speculation: a verify forward of k drafts costs %s decode steps (k=1, 4, "
                "16), measured; corrected while serving",
                [round(cost.relative(1, k + 1), 2) for k in (1, 4, 16)])
    return OnlineCost(cost)


def measure_verify_cost(model: Any, vocab_size: int, repeats: int = 3) -> VerifyCost:
    """Fit ``VerifyCost`` from forwards of width 1, 2 and ``MEASURE_WIDTH`` over a cache
    holding ``MEASURE_CONTEXT`` tokens (attention over a context is part of a verify's
    cost; a cache that cannot be trimmed back is measured empty), and ``attend`` from
    width 1 over that context against an empty cache; the fastest of ``repeats`` each
    after one warm-up."""
    base = make_prompt_cache(model)
    context = MEASURE_CONTEXT if can_trim_prompt_cache(base) else 0
    if context:
        mx.eval(model(_tokens(context, vocab_size), cache=base))

    def once(width: int, empty: bool = False) -> float:
        cache = base if context and not empty else make_prompt_cache(model)
        x = _tokens(width, vocab_size)
        t0 = time.perf_counter()
        mx.eval(model(x, cache=cache))
        took = time.perf_counter() - t0
        if cache is base:
            trim_prompt_cache(cache, width)
        return took

    for w in (1, 2, MEASURE_WIDTH):
        once(w)
    attend = 0.0
    if context:
        once(1, empty=True)
        t0 = min(once(1, empty=True) for _ in range(repeats))
        attend = max(0.0, min(once(1) for _ in range(repeats)) - t0) / context
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
    return VerifyCost(overhead, per_token, wide, attend, context)


def _tokens(n: int, vocab_size: int) -> mx.array:
    return mx.array([[i % max(1, vocab_size - 1) + 1 for i in range(n)]], dtype=mx.uint32)


class Acceptance:
    """One request's decayed counts: draft tokens accepted, drafts cut short."""

    __slots__ = ("accepted", "rejected", "updates", "cut_short")

    def __init__(self, accepted: float = PRIOR_ACCEPTED, rejected: float = PRIOR_REJECTED
                 ) -> None:
        # the prior decays with the counts: what a request's drafts do wins
        self.accepted = accepted
        self.rejected = rejected
        self.updates = 0  # verified drafts counted
        self.cut_short = 0  # ... of which some token was rejected

    def update(self, drafted: int, accepted: int) -> None:
        self.updates += 1
        self.cut_short += accepted < drafted
        self.accepted = DECAY * self.accepted + accepted
        self.rejected = DECAY * self.rejected + (1.0 if accepted < drafted else 0.0)

    @property
    def rate(self) -> float:
        """The chance that the next draft token is accepted. Prior: 2 accepted, 1
        rejected (2/3): a draft exists only where the sequence's last tokens occurred
        before, which is evidence for the tokens that followed."""
        return self.accepted / (self.accepted + self.rejected)

    def prior(self) -> Acceptance:
        """A new request's counts: this rate (the engine's recent drafts) at the weight
        of the fixed prior (2 + 1), so that what the request's own drafts do soon wins."""
        weight = PRIOR_ACCEPTED + PRIOR_REJECTED
        return Acceptance(weight * self.rate, weight * (1.0 - self.rate))


def expected_tokens(rate: float, n: int) -> float:
    """Tokens a row gets from a verify of a draft of ``n`` tokens: its own token plus
    each draft token while every one before it was accepted."""
    return 1.0 + sum(rate ** j for j in range(1, n + 1))


def row_pays(rate: float, length: int, cost: CostModel, rows: int = 1) -> bool:
    """Whether some cut of one row's draft is expected to beat decoding by ``MARGIN``
    on its own (its tokens against the verify's cost per row)."""
    return any(expected_tokens(rate, cut) / cost.relative(rows, 1 + cut) > 1.0 + MARGIN
               for cut in range(1, length + 1))


def row_tokens(rates: Sequence[float], lengths: Sequence[int], cut: int, *,
               uniform: bool = False) -> list[float]:
    """The tokens each row is expected to get from a verify of drafts cut to ``cut``
    (``uniform``: every row keeps as many as the shortest)."""
    per_row = [expected_tokens(q, min(n, cut)) for q, n in zip(rates, lengths, strict=True)]
    return [min(per_row)] * len(per_row) if uniform and per_row else per_row


def row_share(cost: CostModel, rows: int, context: int = 0) -> float:
    """What one row of ``rows`` adds to a decode step of the batch, as a share of that
    step: ``1 - step(rows - 1) / step(rows)`` of the startup fit (``VerifyCost.step``
    over ``context`` tokens; 0 for one row, and for a fixed cost, which says nothing of
    rows). Each step sooner a row leaves the batch, every row still in it decodes that
    share of a step faster (``shared_tokens``). The fit's share, not the measured steps':
    it is taken at one row and is below what rows add on a loaded CPU (0.055 of a step
    at 8 rows against 0.08 measured for SmolLM2 here), so the bound stays on the safe
    side."""
    fit = cost.prior if isinstance(cost, OnlineCost) else cost
    if rows < 2 or not isinstance(fit, VerifyCost):
        return 0.0
    return max(0.0, 1.0 - fit.step(rows - 1, context) / fit.step(rows, context))


def shared_tokens(per_row: Sequence[float], share: float, left: Sequence[int]
                  ) -> list[float]:
    """What a verify is worth to each row in decode steps of the batch: its own expected
    tokens (``per_row``) plus ``share`` x the tokens beyond one that the verify is
    expected to give each other row with no more tokens ``left`` to decode than it
    (``max_tokens`` less its output): such a row leaves the batch that many steps
    sooner, while this one still decodes in it, and each of those steps is ``share``
    cheaper (``row_share``). A row expected to finish first gets nothing from the
    others' gains."""
    if share <= 0.0:
        return list(per_row)
    # tokens left -> the gains of every row with no more left (ascending: the last
    # write for a value has all its ties in)
    ahead: dict[int, float] = {}
    total = 0.0
    for i in sorted(range(len(per_row)), key=left.__getitem__):
        total += per_row[i] - 1.0
        ahead[left[i]] = total
    return [t + share * (ahead[n] - (t - 1.0)) for t, n in zip(per_row, left, strict=True)]


def plan(rates: Sequence[float], lengths: Sequence[int], cost: CostModel, *,
         state: bool = False, uniform: bool = False,
         allowance: Sequence[float] | None = None, share: float = 0.0,
         left: Sequence[int] | None = None) -> int:
    """How many draft tokens each row keeps (its draft cut to that), 0 for no verify.

    ``rates``: each row's acceptance rate; ``lengths``: its draft's length; ``state``:
    array states, fed the kept positions again when a row rejects part of its draft;
    ``uniform``: every row keeps as many positions as the shortest. A cut must beat
    decoding by ``MARGIN`` over all rows; with ``allowance`` (per row, in decode steps:
    ``Credits.allowance``), also no row may expect to lose more than its allowance (a
    row with no draft gets 1 token for the verify's price: the bystander bound), its
    tokens counted with what the other rows' gains save it (``shared_tokens`` with
    ``share`` and each row's tokens ``left``)."""
    rows = len(rates)
    best, best_gain = 0, 1.0 + MARGIN
    for cut in range(1, max(lengths, default=0) + 1):
        per_row = row_tokens(rates, lengths, cut, uniform=uniform)
        tokens = sum(per_row)
        price = verify_price(rates, lengths, cut, cost, state=state, tokens=tokens)
        worth = per_row if left is None else shared_tokens(per_row, share, left)
        if allowance is not None and any(
                t - price < -a for t, a in zip(worth, allowance, strict=True)):
            continue  # some row would lose more time than it may
        gain = tokens / (rows * price)
        if gain > best_gain:
            best, best_gain = cut, gain
    return best


def verify_price(rates: Sequence[float], lengths: Sequence[int], cut: int, cost: CostModel,
                 *, state: bool = False, tokens: float) -> float:
    """What a verify of every draft cut at ``cut`` costs, in decode steps of the batch:
    the forward of ``1 + cut`` positions per row, and over array states (``state``)
    the expected forward that feeds the kept positions again (unless every row keeps
    its whole draft; ``tokens``: the tokens the rows are expected to keep in all)."""
    rows = len(rates)
    price = cost.relative(rows, 1 + cut)
    if state:
        whole = 1.0
        for q, n in zip(rates, lengths, strict=True):
            whole *= q ** cut if n >= cut else 0.0  # a shorter row is padded
        price += (1.0 - whole) * cost.relative(rows, round(tokens / rows))
    return price


class Credits:
    """Per request, the decode steps speculation saved it so far (``balance``): a verify
    of price ``P`` decode steps (``verify_price``, as the gate priced it when it planned
    the verify) expected to be worth ``t`` tokens to a row adds ``t - P`` (decoding
    would have taken ``t`` steps for them): its own expected tokens, plus the steps the
    verify saves it by letting rows that finish before it leave the batch sooner
    (``shared_tokens``). A balance never falls below ``-max_slowdown`` x the tokens
    decoded, since the gate planned the verify within the allowance at that price
    (priced after the verify, with the cost re-measured by it, a row could end in debt
    that no later verify at its own rate repays, and the batch would never verify
    again). A row with no draft of its own in a verify (a bystander) loses ``P - 1``,
    less what the others' gains save it. The gate lets a verify slow a row only by what
    the row has in hand (``allowance``: its balance plus ``max_slowdown`` x the tokens
    it has decoded), so a row that never gains from a draft (a chat next to copying
    rows) is expected to decode at most ``max_slowdown`` slower than without
    speculation over its whole reply, the steps it decodes in a smaller batch because
    copying rows due to finish before it finished sooner counted. Engine thread only."""

    def __init__(self, max_slowdown: float) -> None:
        if not (math.isfinite(max_slowdown) and max_slowdown >= 0.0):
            raise ValueError(f"max_slowdown must be a number >= 0, got {max_slowdown}")
        self.max_slowdown = max_slowdown
        self._balance: dict[str, float] = {}

    def balance(self, request_id: str) -> float:
        return self._balance.get(request_id, 0.0)

    def allowance(self, request_id: str, decoded: int) -> float:
        """The decode steps a verify may cost this row beyond the tokens it gives it."""
        return self.balance(request_id) + self.max_slowdown * decoded

    def settle(self, request_id: str, tokens: float, price: float) -> None:
        """A verify of ``price`` decode steps gave the row ``tokens`` tokens (expected)."""
        self._balance[request_id] = self.balance(request_id) + tokens - price

    def forget(self, request_id: str) -> None:
        self._balance.pop(request_id, None)
