"""The speculator: per request, drafts (``drafts``), the gate (``gate``, priced by
``cost``) and the acceptance that adapts both; the verify step is ``verify``.
The rules (draft lengths, cool-downs, probes, fills, credits): docs/architecture.md."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ...serving_config import EngineConfig
from .. import mlx_compat
from ..formats import constrained
from . import gate
from .cost import FREE, CostModel, OnlineCost
from .drafts import DraftConfig, DraftPools, TenantDrafts, propose
from .gate import Acceptance, Credits
from .state import Fills, Row, RowState, SpecCounters

# (request, k) -> up to k draft tokens following the request's sequence (tests)
DraftSource = Callable[[Any, int], Sequence[int]]
# tenant -> the token sequences the cache stores for it (``PromptCache.token_history``)
History = Callable[[str], Sequence[Sequence[int]]]

logger = logging.getLogger(__name__)

MIN_K = 2
# the longest pause in drafting after fully rejected drafts, in decode steps
MAX_COOL = 16
# a row whose drafts do not pay drafts nothing for this many steps, then probes ...
PROBE_STEPS = 16
# ... with its acceptance rate taken as at least this ...
PROBE_RATE = 0.9
# ... and each pause with no draft token accepted since the last is twice as long, up to:
MAX_PROBE_STEPS = 1024
# a row whose history found no draft this many steps in a row looks again only every
# EMPTY_SKIP + 1 steps
EMPTY_RUN = 4
EMPTY_SKIP = 2


class Speculator:
    """Speculative decoding for one engine (engine thread only)."""

    def __init__(self, config: EngineConfig, source: DraftSource | None = None,
                 history: History | None = None, cost: CostModel | None = None) -> None:
        self.max_k = config.spec_max_draft
        self.max_rows = config.spec_max_rows
        self.drafts_config = DraftConfig(min_n=config.spec_min_match,
                                         max_n=max(config.spec_min_match, 8),
                                         max_k=config.spec_max_draft,
                                         pool_tokens=config.spec_pool_tokens)
        self.pools = DraftPools(self.drafts_config)
        self.pool_prompt_tokens = config.spec_pool_prompt_tokens
        self.counters = SpecCounters()
        self.source = source
        self.history = history
        # what a verify forward costs, in decode steps (default: one decode step)
        self.cost: CostModel = cost if cost is not None else FREE
        self.clock: Callable[[], float] = time.perf_counter
        self._state: dict[str, RowState] = {}  # request id -> its speculation state
        self._recent = Acceptance()  # every request's drafts: a new request's prior
        self._seeded: set[str] = set()  # tenants whose pool took the cache's history
        self._fills = Fills()
        # per request, the decode steps verifies saved it: what a verify may cost it
        self.credits = Credits(config.spec_max_slowdown)
        # per row of the verify the gate planned last, the tokens it expected, and the
        # price it planned with (``settle``)
        self._expected: list[float] = []
        self._price = 0.0
        # seconds spent seeding tenant pools, and a verify step's start (``step_started``)
        self._seeding_s = 0.0
        self._step: tuple[float, float] = (0.0, 0.0)

    def row(self, r: Row | str) -> RowState:
        rid = r if isinstance(r, str) else r.request_id
        st = self._state.get(rid)
        if st is None:
            st = self._state[rid] = RowState()
        return st

    def _k(self, st: RowState) -> int:
        return st.k if st.k is not None else max(MIN_K, self.max_k // 2)

    def eligible(self, rows: Sequence[Row], cache: Sequence[Any], model: Any) -> bool:
        """A verify forward can serve these rows: at most ``max_rows``, caches whose
        rejected positions can be taken back, no logits processors but grammars, no
        logits hook; rows over array states that cannot take right padding must all be
        greedy. A batch size the guard paused counts the step for its rows."""
        if not rows or len(rows) > self.max_rows:
            return False
        kind = mlx_compat.speculation_kind(cache)
        if kind is None:
            return False
        if kind == "state" and len(rows) > 1 and not mlx_compat.states_take_lengths(model) \
                and not all(r.sampler.greedy and not r.processors for r in rows):
            return False
        if not all(constrained.speculates(r.processors) and r.ctx.logits_hook is None
                   for r in rows):
            return False
        if isinstance(self.cost, OnlineCost) and not self.cost.allows(len(rows)):
            for r in rows:
                self.row(r).tick()
            return False
        return True

    def waiting(self, rows: Sequence[Row]) -> bool:
        """Every row cools down or pauses this step: count the step for each."""
        if not all(self.row(r).waits() for r in rows):
            return False
        for r in rows:
            self.row(r).tick()
        return True

    def propose(self, r: Row) -> tuple[int, ...]:
        """Draft tokens after ``r``'s sequence; none while it cools down or pauses."""
        st = self.row(r)
        if st.tick():
            return ()
        k = st.k = self._k(st)
        # looked up ``max_k`` long: what lies past ``k`` may extend the draft into the
        # positions a wider verify pads anyway (``plan``)
        if self.source is not None:
            st.source = "source"
            tokens = tuple(int(t) for t in self.source(r, self.max_k))[:self.max_k]
        else:
            draft = propose(st.synced(r, self.drafts_config), self._pool(r.req.tenant),
                            self.max_k)
            st.source, st.at, tokens = draft.source, draft.at, draft.tokens
            if tokens:
                st.empty = 0
            else:  # nothing to copy here: after EMPTY_RUN such steps, look less often
                st.empty += 1
                if st.empty >= EMPTY_RUN:
                    st.skip = EMPTY_SKIP
        if len(tokens) > k and not r.processors:
            st.more = tokens
        return self._grammar_cut(r, tokens[:k])

    def fill(self, r: Row, k: int) -> tuple[int, ...]:
        """A draft for a row that drafts nothing this step, for the positions a verify
        pads anyway: no cool-down, pause or skip is counted."""
        if r.processors or k <= 0:
            return ()
        if self.source is not None:
            return tuple(int(t) for t in self.source(r, k))[:k]
        st = self.row(r)
        draft = propose(st.synced(r, self.drafts_config), self.pools.get(r.req.tenant), k)
        st.at = draft.at
        return draft.tokens

    def _grammar_cut(self, r: Row, draft: tuple[int, ...]) -> tuple[int, ...]:
        """A constrained row's draft up to the first token its grammar rejects after the
        pending token (``r.output[-1]``, reported, not yet fed)."""
        if not r.processors or not draft:
            return draft
        n = constrained.grammar_prefix(r.processors, r.output[-1], draft)
        self.counters.spec_grammar_cut += len(draft) - n
        return draft[:n]

    def _pool(self, tenant: str) -> TenantDrafts | None:
        """``tenant``'s pool, seeded the first time with the token ids the cache stores
        for it (drafts survive a restart and are shared between servers)."""
        if self.history is not None and tenant not in self._seeded:
            self._seeded.add(tenant)
            t0 = self.clock()
            try:
                seqs = self.history(tenant)
            except Exception:
                logger.exception("reading the cache's token history for the draft pool failed")
                seqs = []
            for seq in seqs:
                self.pools.add(tenant, seq)
            self.counters.spec_pool_seeded += sum(len(s) for s in seqs)
            self._seeding_s += self.clock() - t0
        return self.pools.get(tenant)

    def feedback(self, r: Row, drafted: int, accepted: int) -> None:
        """``r``'s verified draft of ``drafted`` tokens had ``accepted`` accepted."""
        c, st = self.counters, self.row(r)
        c.spec_verifies += 1
        c.spec_drafted += drafted
        c.spec_accepted += accepted
        st.verified(accepted)
        if st.fill:
            st.fill = False
            self._fills.count(r, c, drafted, accepted)
            self._fills.acceptance.update(drafted, accepted)
            if accepted:  # back in sync: its cool-down ends
                st.cool = (0, 0)
            return
        own = st.extended if st.extended is not None else drafted
        st.extended = None
        if own < drafted:
            # the extension past the row's own draft was verified in padding: counted
            # as a fill; the row's rate, k and cool-down see its own draft only
            self._fills.count(r, c, drafted - own, max(0, accepted - own))
            drafted, accepted = own, min(accepted, own)
        if st.source == "pool":
            c.spec_pool_drafted += drafted
            c.spec_pool_accepted += accepted
        r.usage.spec_drafted += drafted
        r.usage.spec_accepted += accepted
        self._acceptance(r).update(drafted, accepted)
        self._recent.update(drafted, accepted)
        k = st.k if st.k is not None else self.max_k
        st.k = min(self.max_k, 2 * k) if accepted == drafted else max(MIN_K, accepted + 1)
        # a fully rejected draft: no drafts for 1, 2, 4, ... MAX_COOL steps in a row
        if accepted == 0:
            last = st.cool[1]
            wait = min(MAX_COOL, 2 * last if last else 1)
            st.cool = (wait, wait)
        else:
            st.cool = (0, 0)
            st.pause = (0, 0)  # drafts pay again: a later pause starts short

    def plan(self, rows: Sequence[Row], drafts: list[Sequence[int]],
             cache: Sequence[Any], model: Any) -> int:
        """How many tokens of its draft each row feeds in a verify forward, 0: decode as
        usual. A row whose draft does not pay on its own has it emptied in ``drafts``
        and pauses; fills and extensions are written into ``drafts``."""
        if not any(drafts):  # a sync and drafting for nothing, as a gated step
            self._gated(len(rows), idle=True)
            return 0
        cut, lengths, fills, dropped, (self._expected, self._price) = self._decide(
            rows, drafts, cache, model, self.fill)
        self._drop(rows, dropped, drafts)
        if cut:
            for i, n in enumerate(lengths):
                st = self.row(rows[i])
                if i in fills:
                    drafts[i] = fills[i]
                    st.fill = True
                elif n == 0 and drafts[i]:
                    drafts[i] = ()
                elif 0 < n < cut and len(st.more) > n:
                    # the verify is ``cut`` wide for this row anyway: its draft goes on
                    # there (the row's own gate, k and rate count its first n tokens)
                    st.extended = n
                    drafts[i] = st.more[:cut]
        else:
            self._gated(len(rows))
        return cut

    def _decide(self, rows: Sequence[Row], drafts: Sequence[Sequence[int]],
                cache: Sequence[Any], model: Any,
                fill: Callable[[Row, int], tuple[int, ...]]
                ) -> tuple[int, list[int], dict[int, tuple[int, ...]], list[int],
                     tuple[list[float], float]]:
        """The gate's decision alone: ``(cut, each row's draft length, the fills, the
        rows whose own draft does not pay, (each row's expected worth, the price))``."""
        state = mlx_compat.speculation_kind(cache) == "state"
        uniform = state and len(rows) > 1 and not mlx_compat.states_take_lengths(model)
        rates = [self._rate(r) for r in rows]
        lengths = [len(d) for d in drafts]
        dropped = [i for i, n in enumerate(lengths)
                   if n and not gate.row_pays(rates[i], n, self.cost, len(rows))]
        for i in dropped:
            lengths[i] = 0
        fills: dict[int, tuple[int, ...]] = {}
        if not any(lengths):
            return 0, lengths, fills, dropped, ([], 0.0)
        for i, r in enumerate(rows):
            if lengths[i] == 0:
                found = fill(r, self.max_k)
                if found:
                    fills[i] = found
                    lengths[i], rates[i] = len(found), self._fills.rate
        allowance = [self.credits.allowance(r.request_id, len(r.output)) for r in rows]
        share = gate.row_share(self.cost, len(rows), max(r.pos for r in rows))
        left = [r.req.sampling.max_tokens - len(r.output) for r in rows]
        cut = gate.plan(rates, lengths, self.cost, state=state, uniform=uniform,
                        allowance=allowance, share=share, left=left)
        if not cut:
            return 0, lengths, fills, dropped, ([], 0.0)
        expected = gate.row_tokens(rates, lengths, cut, uniform=uniform)
        price = gate.verify_price(rates, lengths, cut, self.cost, state=state,
                                  tokens=sum(expected))
        return cut, lengths, fills, dropped, (gate.shared_tokens(expected, share, left), price)

    def _drop(self, rows: Sequence[Row], dropped: Sequence[int],
              drafts: Sequence[Sequence[int]]) -> None:
        """Rows whose drafts did not pay pause; the probe of every row that drafted is
        spent."""
        for i in dropped:
            self._hold(rows[i])
        for r, d in zip(rows, drafts, strict=True):
            if d:
                self.row(r).probing = False

    def presync(self, rows: Sequence[Row], cache: Sequence[Any], model: Any,
                reported: Sequence[bool]) -> bool:
        """Before the pending tokens are read: would the gate verify the drafts the rows'
        sequences give without them (``reported``: rows whose pending token is in their
        output already)? No: the step stays pipelined, each row's wait counts it and
        rows whose drafts did not pay pause (``spec_presync_gated``). Not with a
        ``source`` (asked after the sync)."""
        if self.source is not None:
            return True
        ahead = {r.request_id: not known for r, known in zip(rows, reported, strict=True)}
        drafts = [() if self.row(r).waits() else self._ahead(
            r, self._k(self.row(r)), ahead[r.request_id]) for r in rows]
        if any(drafts):
            cut, _, _, dropped, _ = self._decide(
                rows, drafts, cache, model,
                lambda r, k: () if r.processors else self._ahead(r, k, ahead[r.request_id]))
            if cut:
                return True
        else:
            dropped = []
        for r in rows:
            self.row(r).tick()
        self._drop(rows, dropped, drafts)
        self.counters.spec_presync_gated += 1
        return False

    def _ahead(self, r: Row, k: int, ahead: bool = True) -> tuple[int, ...]:
        """Up to ``k`` tokens after the pending one, drafted before it is read
        (``ahead``; else it is the sequence's last)."""
        index = self.row(r).synced(r, self.drafts_config)
        tokens = propose(index, self._pool(r.req.tenant), k + int(ahead)).tokens
        return tokens[1:] if ahead else tokens

    def _gated(self, rows: int, *, idle: bool = False) -> None:
        """A step that read the pending tokens and drafted for no verify: gated, or
        ``idle`` (no row found a draft)."""
        self.counters.spec_gated += not idle
        if isinstance(self.cost, OnlineCost):
            before = self.cost.guard.gated_off
            self.cost.observe_gated(rows, idle=idle)
            self.counters.spec_guard_off += self.cost.guard.gated_off - before

    def _rate(self, r: Row) -> float:
        """``r``'s acceptance rate for the gate: at least ``PROBE_RATE`` while it probes
        and until a draft of its own is cut short."""
        acc = self._acceptance(r)
        return max(acc.rate, PROBE_RATE) \
            if self.row(r).probing or not acc.cut_short else acc.rate

    def _hold(self, r: Row) -> None:
        """``r``'s drafts do not pay: no drafts for ``PROBE_STEPS`` steps, twice as many
        as last time while no verify since accepted a token (``MAX_PROBE_STEPS``)."""
        st = self.row(r)
        last = st.pause[1]
        wait = min(MAX_PROBE_STEPS, 2 * last) if last else PROBE_STEPS
        st.pause = (wait, wait)
        self.counters.spec_paused += 1

    def observe_decode(self, rows: int, seconds: float, context: int) -> None:
        """A plain decode step of ``rows`` rows over ``context`` tokens took ``seconds``."""
        if isinstance(self.cost, OnlineCost):
            self.cost.observe_decode(rows, seconds, context)

    def observe_verify(self, rows: int, width: int, seconds: float, context: int) -> None:
        """A verify forward of ``rows`` x ``width`` over ``context`` took ``seconds``."""
        if isinstance(self.cost, OnlineCost):
            self.cost.observe_verify(rows, width, seconds, context)

    def settle(self, rows: Sequence[Row]) -> None:
        """The verify the gate planned last ran: each row's credit gains what the gate
        expected it to be worth to the row, less the price it planned with."""
        for r, e in zip(rows, self._expected, strict=True):
            self.credits.settle(r.request_id, e, self._price)

    def step_started(self) -> None:
        """A verify step begins (before its drafts): ``step_done`` times it whole."""
        self._step = (self.clock(), self._seeding_s)
        for st in self._state.values():
            st.more = ()

    def step_done(self, rows: int, width: int, tokens: int, context: int) -> None:
        """The verify step begun last gave ``tokens`` tokens: its wall time, less any
        pool seeding in it, goes to the guard."""
        if isinstance(self.cost, OnlineCost):
            t0, seeding = self._step
            before = self.cost.guard.turned_off
            self.cost.observe_step(rows, width, tokens,
                                   self.clock() - t0 - (self._seeding_s - seeding), context)
            self.counters.spec_guard_off += self.cost.guard.turned_off - before

    def _acceptance(self, r: Row) -> Acceptance:
        st = self.row(r)
        if st.acc is None:
            st.acc = self._recent.prior()
        return st.acc

    def remember(self, r: Row) -> None:
        """A finished request's output and the last ``pool_prompt_tokens`` of its prompt
        join its tenant's pool."""
        if not r.output or self.drafts_config.pool_tokens == 0:
            return
        start = max(0, r.n_prompt - self.pool_prompt_tokens)
        self.pools.add(r.req.tenant,
                       [int(t) for t in r.seq[start:r.n_prompt + len(r.output)].tolist()])

    def forget(self, r: Row | str) -> None:
        rid = r if isinstance(r, str) else r.request_id
        self._state.pop(rid, None)
        self.credits.forget(rid)
