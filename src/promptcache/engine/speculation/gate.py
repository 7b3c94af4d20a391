"""The gate's arithmetic: each row's acceptance (``Acceptance``), what a verify of drafts
cut at some length is expected to give and cost (``plan``, ``verify_price``,
``shared_tokens``) and each row's allowance (``Credits``). Pure arithmetic."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .cost import CostModel, OnlineCost, VerifyCost

# a verify must be expected to beat decoding by this fraction
MARGIN = 0.05
# how much of a row's acceptance history each new verify keeps
DECAY = 0.9
PRIOR_ACCEPTED = 2.0
PRIOR_REJECTED = 1.0


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
    """What one row of ``rows`` adds to a decode step, as a share of it: ``1 -
    step(rows - 1) / step(rows)`` of the startup fit (0 for one row or a fixed cost).
    The fit's share is below what rows add on a loaded CPU: the bound stays safe."""
    fit = cost.prior if isinstance(cost, OnlineCost) else cost
    if rows < 2 or not isinstance(fit, VerifyCost):
        return 0.0
    return max(0.0, 1.0 - fit.step(rows - 1, context) / fit.step(rows, context))


def shared_tokens(per_row: Sequence[float], share: float, left: Sequence[int]
                  ) -> list[float]:
    """What a verify is worth to each row, in decode steps: its own expected tokens plus
    ``share`` x the tokens beyond one it gives each row with no more tokens ``left``
    (such a row leaves the batch that many steps sooner, each step ``share`` cheaper)."""
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
    """How many draft tokens each row keeps (its draft cut to that), 0 for no verify: a
    cut must beat decoding by ``MARGIN`` over all rows (``state``: array states, fed
    again after a rejection; ``uniform``: every row keeps as many as the shortest), and
    no row may expect to lose more than its ``allowance`` (``Credits``), its worth
    counted with what the others' gains save it (``shared_tokens``)."""
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
    """Per request, the decode steps speculation saved it (``balance``): a verify of
    price ``P`` (as planned, not re-measured: no debt no later verify repays) worth ``t``
    tokens to a row adds ``t - P``. A verify may slow a row only by its ``allowance``
    (balance + ``max_slowdown`` x its tokens): a row that never gains from a draft is
    at most ``max_slowdown`` slower over its reply. Engine thread only."""

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
