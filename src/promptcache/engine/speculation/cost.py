"""What a verify forward costs, in decode steps: the startup fit (``VerifyCost``), a fixed table
(``TableCost``, ``--spec-verify-cost``) or the fit corrected online (``OnlineCost``); and
``StepGuard``: per batch size, a size whose verify steps lose to plain decode stops speculating."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from ..steps import Steps, no_steps

logger = logging.getLogger(__name__)

MEASURE_WIDTH = 16
# tokens in the cache the verify cost is measured over
MEASURE_CONTEXT = 1024
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


# verify steps of one batch size judged together
WINDOW = 4
# verifying must deliver at least this share of decoding's tokens per second less this
SLACK = 0.02
OFF_STEPS = 32
MAX_OFF_STEPS = 1024
# gated steps in a row that pause a batch size, and for how long
GATED_RUN = 2
GATED_OFF_STEPS = 4
MAX_GATED_OFF_STEPS = 64
# ... and for steps whose rows found no draft: a copy that starts during the pause
# starts being verified at most this many steps late
MAX_IDLE_OFF_STEPS = 16


@dataclass
class _Size:
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    off_left: int = 0
    last_off: int = 0
    gated_run: int = 0
    last_gated_off: int = 0


class StepGuard:
    """Per batch size: speculation allowed or paused, from measured tokens per second
    (module docstring). ``decode_seconds(rows, context)``: a plain decode step of
    ``rows`` rows over ``context`` tokens."""

    def __init__(self, decode_seconds: Callable[[int, int], float]) -> None:
        self._decode_seconds = decode_seconds
        self._sizes: dict[int, _Size] = {}
        self.turned_off = 0
        self.gated_off = 0

    def allows(self, rows: int) -> bool:
        """Whether a batch of ``rows`` rows may speculate this step (a paused size
        counts the step)."""
        s = self._sizes.get(rows)
        if s is None or s.off_left <= 0:
            return True
        s.off_left -= 1
        return False

    def observe_step(self, rows: int, tokens: int, seconds: float, context: int = 0
                     ) -> None:
        """A verify step of ``rows`` rows over ``context`` tokens gave ``tokens`` tokens
        in ``seconds``."""
        if rows <= 0 or seconds <= 0:
            return
        s = self._sizes.setdefault(rows, _Size())
        s.gated_run, s.last_gated_off = 0, 0
        s.tokens += tokens
        s.seconds += seconds
        s.steps += 1
        if s.steps < WINDOW:
            return
        verify_rate = s.tokens / s.seconds
        decode_rate = rows / self._decode_seconds(rows, context)
        s.tokens, s.seconds, s.steps = 0, 0.0, 0
        if verify_rate >= (1.0 - SLACK) * decode_rate:
            s.last_off = 0
            return
        s.last_off = min(MAX_OFF_STEPS, 2 * s.last_off) if s.last_off else OFF_STEPS
        s.off_left = s.last_off
        self.turned_off += 1

    def observe_gated(self, rows: int, *, cap: int = MAX_GATED_OFF_STEPS) -> None:
        """A step of ``rows`` rows had drafts and the gate decoded as usual, or (``cap``
        ``MAX_IDLE_OFF_STEPS``) found no draft."""
        s = self._sizes.setdefault(rows, _Size())
        s.gated_run += 1
        if s.gated_run < GATED_RUN:
            return
        s.gated_run = 0
        s.last_gated_off = min(cap, 2 * s.last_gated_off) \
            if s.last_gated_off else GATED_OFF_STEPS
        s.off_left = max(s.off_left, s.last_gated_off)
        self.gated_off += 1

    def paused(self) -> dict[int, int]:
        """Batch sizes paused now -> the steps left."""
        return {n: s.off_left for n, s in sorted(self._sizes.items()) if s.off_left > 0}


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
    from ...serving_config import verify_cost_steps

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
