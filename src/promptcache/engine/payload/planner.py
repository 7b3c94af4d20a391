"""Restore or recompute (Cake, ICML 2025): a matched prefix's lower-tier blocks are
loaded, prefilled again from their tokens, or split (the head prefilled while the tail
loads, meeting in the middle), whichever the measured rates (``Rates``) predict first.
Pure Python: the engine feeds the rates and executes the plan (``request_saves.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

RAM = "ram"
POLICIES = ("auto", "load", "recompute")
KINDS = ("load", "recompute", "split")
# after this many recomputes in a row, one load re-measures the tiers (their read rates
# would otherwise go stale while recompute keeps winning)
PROBE_EVERY = 16


@dataclass(frozen=True, slots=True)
class Span:
    """One matched block: its tier (``ram`` or a lower tier's name), tokens, bytes."""

    tier: str
    start: int
    end: int
    nbytes: int


class Fit:
    """``y = a*x1 + b*x2`` (a, b >= 0) by least squares over exponentially decayed
    samples (each new one weighs ``1 / (1 - decay)`` times the average old one). When
    the two features cannot be told apart (always proportional) or a coefficient would
    be negative, ``x1`` alone (``primary=0``) or ``x2`` alone (``primary=1``) is fitted."""

    def __init__(self, primary: int, decay: float = 0.9) -> None:
        self.primary, self.decay = primary, decay
        self.samples = 0
        self._s = [0.0] * 5  # x1x1, x1x2, x2x2, x1y, x2y

    def add(self, x1: float, x2: float, y: float) -> None:
        if not (y >= 0 and x1 >= 0 and x2 >= 0) or math.isinf(y) or x1 + x2 <= 0:
            return
        d = self.decay
        self._s = [d * s + v for s, v in zip(self._s, (x1 * x1, x1 * x2, x2 * x2,
                                                         x1 * y, x2 * y), strict=True)]
        self.samples += 1

    def coef(self) -> tuple[float, float] | None:
        if not self.samples:
            return None
        s11, s12, s22, s1y, s2y = self._s
        det = s11 * s22 - s12 * s12
        if det > 1e-9 * s11 * s22:
            a, b = (s22 * s1y - s12 * s2y) / det, (s11 * s2y - s12 * s1y) / det
            if a >= 0 and b >= 0:
                return a, b
        if self.primary == 0:
            return (s1y / s11 if s11 > 0 else 0.0), 0.0
        return 0.0, (s2y / s22 if s22 > 0 else 0.0)

    def __call__(self, x1: float, x2: float) -> float | None:
        c = self.coef()
        return None if c is None else c[0] * x1 + c[1] * x2


@dataclass
class Rates:
    """The measured rates, fed online from real requests (engine thread):
    ``prefill``: seconds = a*tokens + b*(sum of their positions) (attention grows with
    the position); ``reads[tier]``: seconds = latency*reads + bytes/bandwidth of one
    tier's reads (promotion: tier bytes to payloads); ``restore``: seconds per copy and
    per byte of a restore into the model's caches (every loaded block, RAM ones too);
    ``split[tier]``: a split's measured seconds = a*min(head, read) + b*(max(head, read)
    + restore) (a: the contention of the head's prefill and the tail's read, 0 when
    they overlap for free, 1 when they run one after the other; b: the rest's scale)."""

    prefill: Fit = field(default_factory=lambda: Fit(0))
    reads: dict[str, Fit] = field(default_factory=dict)
    restore: Fit = field(default_factory=lambda: Fit(1))
    split: dict[str, Fit] = field(default_factory=dict)

    def record_prefill(self, chunks: Sequence[tuple[int, int]], seconds: float) -> None:
        """One forward over ``(first position, tokens)`` chunks (a batch's rows)."""
        self.prefill.add(sum(n for _, n in chunks),
                         sum(n * p + n * (n - 1) / 2 for p, n in chunks), seconds)

    def record_read(self, tier: str, reads: int, nbytes: int, seconds: float) -> None:
        self.reads.setdefault(tier, Fit(1)).add(reads, nbytes, seconds)

    def record_split(self, tier: str, overlap: tuple[float, float], seconds: float) -> None:
        """A split took ``seconds`` where ``plan`` predicted ``overlap`` (``Plan.overlap``)."""
        self.split.setdefault(tier, Fit(1)).add(*overlap, seconds)

    def split_s(self, tier: str, head_s: float, read_s: float, restore_s: float) -> float:
        """A split's seconds from its parts (unmeasured: a free overlap)."""
        lo, hi = min(head_s, read_s), max(head_s, read_s) + restore_s
        fit = self.split.get(tier)
        t = fit(lo, hi) if fit is not None else None
        return hi if t is None else t

    def prefill_s(self, start: int, end: int) -> float | None:
        n = end - start
        return self.prefill(n, n * start + n * (n - 1) / 2)

    def snapshot(self) -> dict[str, Any]:
        def one(f: Fit, names: tuple[str, str]) -> dict[str, Any]:
            c = f.coef()
            return {"samples": f.samples, names[0]: c and c[0], names[1]: c and c[1]}
        return {"prefill": one(self.prefill, ("s_per_token", "s_per_token_position")),
                "restore": one(self.restore, ("s_per_copy", "s_per_byte")),
                "reads": {t: one(f, ("s_per_read", "s_per_byte"))
                          for t, f in sorted(self.reads.items())},
                "split": {t: one(f, ("contention", "scale"))
                          for t, f in sorted(self.split.items())}}


@dataclass(frozen=True, slots=True)
class Plan:
    """Tokens ``[0, head)`` load from RAM, ``[head, split)`` are prefilled from tokens,
    ``[split, end)`` load (in the background while the head prefills, for a split).
    ``why``: auto | forced | stateful (the cache cannot take a head recomputed
    under a loaded tail) | unmeasured (a rate is not known yet) | probe (a load after
    ``PROBE_EVERY`` recomputes in a row, re-measuring the tier). Predicted seconds of
    each choice (None: unknown; ``split_s`` None where no split was considered);
    ``overlap``: a chosen split's ``(min(head, read), max(head, read) + restore)``
    seconds, which its measured time is fitted against (``Rates.split``)."""

    kind: str
    why: str
    head: int
    split: int
    end: int
    load_s: float | None = None
    recompute_s: float | None = None
    split_s: float | None = None
    overlap: tuple[float, float] | None = None

    @property
    def keep(self) -> int:
        """The tokens the cache hands over now (the rest is recomputed or read apart)."""
        return self.end if self.kind == "load" else self.head

    @property
    def predicted_s(self) -> float | None:
        return {"load": self.load_s, "recompute": self.recompute_s,
                "split": self.split_s}[self.kind]

    def describe(self) -> str:
        """The request log's words: kind/why[head:split:end] and the predicted times,
        e.g. ``recompute/auto[128:4096:4096],load=0.920s,recompute=0.310s``."""
        times = (("load", self.load_s), ("recompute", self.recompute_s),
                 ("split", self.split_s))
        return ",".join([f"{self.kind}/{self.why}[{self.head}:{self.split}:{self.end}]",
                         *(f"{k}={v:.3f}s" for k, v in times if v is not None)])

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "why": self.why, "load_tokens": self.keep,
                "recompute": [self.head, self.split], "tail_load": [self.split, self.end],
                "predicted_s": {"load": self.load_s, "recompute": self.recompute_s,
                                "split": self.split_s}}


class _Meta(Protocol):
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...
    @property
    def nbytes(self) -> int: ...


class MatchView(Protocol):
    """What the planner reads of a cache match (``cache.Match``)."""

    num_tokens: int

    @property
    def blocks(self) -> Sequence[_Meta]: ...
    @property
    def tiers(self) -> Sequence[str]: ...


class Planner:
    """The engine's planner: its policy (``--restore-plan``), whether its model's
    caches qualify (plain or quantized KV: no state snapshot, no sliding window), the
    rates it measures, and whether it can run a split (``concurrent``)."""

    def __init__(self, policy: str = "auto", qualifies: bool = True,
                 concurrent: bool = False) -> None:
        if policy not in POLICIES:
            raise ValueError(f"restore plan must be one of {', '.join(POLICIES)}, "
                             f"got {policy!r}")
        self.policy, self.qualifies, self.concurrent = policy, qualifies, concurrent
        self.rates = Rates()
        self.recomputes = 0  # auto recomputes in a row (PROBE_EVERY)

    def decide(self, match: MatchView, num_tokens: int | None = None) -> Plan | None:
        """The plan for ``match``'s first ``num_tokens`` tokens (default all of it)."""
        n = match.num_tokens if num_tokens is None else min(num_tokens, match.num_tokens)
        spans = [Span(t, m.start, min(m.end, n), m.nbytes)
                 for m, t in zip(match.blocks, match.tiers, strict=True) if m.start < n]
        p = plan(spans, self.rates, policy=self.policy, qualifies=self.qualifies,
                 concurrent=self.concurrent)
        if p is None or p.why != "auto":
            return p
        if p.kind != "recompute":
            self.recomputes = 0
            return p
        self.recomputes += 1
        if self.recomputes <= PROBE_EVERY:
            return p
        self.recomputes = 0
        return dataclasses.replace(p, kind="load", why="probe", split=p.head)


def plan(spans: Sequence[Span], rates: Rates, *, policy: str = "auto",
         qualifies: bool = True, concurrent: bool = False) -> Plan | None:
    """The plan for a matched prefix (None: every block is in RAM, nothing to decide).
    ``qualifies``: the cache is plain or quantized KV attention (else: load-only);
    ``concurrent``: the engine can prefill the head while the tail, one lower tier's
    blocks, loads (else only load-only and recompute-only are candidates). Chooses the least predicted time,
    load on a tie; never a plan predicted slower than load-only or recompute-only."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if not spans or all(b.tier == RAM for b in spans):
        return None
    end = spans[-1].end
    h = next(i for i, b in enumerate(spans) if b.tier != RAM)
    head = spans[h].start
    if not qualifies:
        return Plan("load", "stateful", head, head, end)
    if policy != "auto":
        kind = policy
        return Plan(kind, "forced", head, head if kind == "load" else end, end)
    times = _times(spans[h:], rates)
    pre = rates.prefill_s(head, end)
    if times is None or pre is None:
        return Plan("load", "unmeasured", head, head, end)
    ram_s = _restore_s(spans[:h], rates)
    load_s = ram_s + times[0][0] + times[0][1]
    rec_s = ram_s + pre
    best = ("load", head, load_s) if load_s <= rec_s else ("recompute", end, rec_s)
    split_s, where, overlap = None, end, None
    if concurrent:  # the tail: one lower tier's blocks (read with one get_many)
        first = len(spans)
        while first > h and spans[first - 1].tier == spans[-1].tier != RAM:
            first -= 1
        for i in range(max(h + 1, first), len(spans)):
            at = spans[i].start
            head_s = rates.prefill_s(head, at) or 0.0
            read_s, restore_s = times[i - h]
            t = ram_s + rates.split_s(spans[-1].tier, head_s, read_s, restore_s)
            if split_s is None or t < split_s:
                split_s, where = t, at
                overlap = (min(head_s, read_s), max(head_s, read_s) + restore_s)
        if split_s is not None and split_s < best[2]:
            best = ("split", where, split_s)
    return Plan(best[0], "auto", head, best[1], end, load_s, rec_s, split_s,
                overlap if best[0] == "split" else None)


def _restore_s(spans: Sequence[Span], rates: Rates) -> float:
    if not spans:
        return 0.0
    return rates.restore(len(spans), sum(b.nbytes for b in spans)) or 0.0


def _times(spans: Sequence[Span], rates: Rates) -> list[tuple[float, float]] | None:
    """For each i: (the read seconds, the restore seconds) of ``spans[i:]``: each run of
    one lower tier is one read; RAM blocks read nothing. None if a tier is unmeasured."""
    coef: dict[str, tuple[float, float]] = {}
    for b in spans:
        if b.tier != RAM and b.tier not in coef:
            c = rates.reads[b.tier].coef() if b.tier in rates.reads else None
            if c is None:
                return None
            coef[b.tier] = c
    rc = rates.restore.coef() or (0.0, 0.0)
    out: list[tuple[float, float]] = [(0.0, 0.0)] * (len(spans) + 1)
    for i in range(len(spans) - 1, -1, -1):
        b = spans[i]
        read, restore = out[i + 1]
        restore += rc[0] + rc[1] * b.nbytes
        if b.tier != RAM:
            lat, per_byte = coef[b.tier]
            read += per_byte * b.nbytes + lat
            if i + 1 < len(spans) and spans[i + 1].tier == b.tier:
                read -= lat  # one read per run: the run now starts here
        out[i] = (read, restore)
    return out[:-1]
