"""Speculative decoding drafted from history (``--speculation suffix``).

A decode step of a request whose draft source (``drafts.SequenceDrafts``: its own
prompt + output) proposes ``d1..dm`` feeds ``[t, d1..dm]`` in ONE forward (``t``: the
token sampled last) and keeps the longest prefix of the draft that greedy decoding
would have produced (``argmax`` at each position equals the next draft token), plus the
model's own token after it: 1 + accepted tokens per forward, exactly the tokens
decoding one at a time gives. The cache's rejected positions are trimmed.

With sampling (temperature > 0) each position is sampled in order with the request's own
key (split once per sample, as when decoding one token at a time) and a draft token is
accepted only if it equals that sample: the same tokens for the same seed, the
distribution unchanged.

Where it runs (``Speculator.eligible``): batches of at most ``spec_max_rows`` rows, all
of them greedy or sampled (log-probabilities of every emitted token from the verify
forward's logits at its position), no logits processors but grammar constraints (a
constrained row's draft is cut at the first token its grammar rejects, and its
processor masks each position only once the draft tokens before it were accepted, so
its matcher consumes exactly the kept tokens: ``constrained.grammar_prefix``), no logits hook,
and caches that can take a verify's rejected positions back
(``mlx_compat.speculation_kind``): plain KV and MLA (trimmed), sliding windows (the
window keeps exactly what decoding one token at a time would hold), and array / SSM
states next to KV (hybrids: the states are put back as they were before the verify and
the accepted tokens are fed again, ``batch_verify.repair``). Everything else decodes as
before. The number of draft tokens adapts per request (doubles after a fully accepted draft, falls
to accepted + 1 after a rejection, at least ``MIN_K``); after a fully rejected draft the
request drafts nothing for 1, 2, 4 ... ``MAX_COOL`` steps, so a request whose drafts keep
failing decodes almost as without speculation; a request whose history found no draft
``EMPTY_RUN`` steps in a row looks again only every ``EMPTY_SKIP + 1`` steps. Several
rows verify in one forward of ``[rows, 1 + longest draft]``; a row with no draft of its
own this step fills its padding there with its best draft, and a shorter draft goes on
there past the row's own k (``spec_rows.Fills``).

The gate (``spec_cost``) prices a verify with ``cost``: by default the startup fit
corrected by the wall time of the verify forwards and decode steps the batch runs
(``observe_verify`` / ``observe_decode``, with ``clock``; ``spec_cost.OnlineCost``).
Per row, a draft that is not expected to pay on its own at that cost
(``spec_cost.row_pays``: the row's acceptance rate, the verify's price) is dropped and
the row drafts nothing for ``PROBE_STEPS`` steps, then probes once with an optimistic
rate (``PROBE_RATE``); each further pause with no draft token accepted in between is
twice as long, up to ``MAX_PROBE_STEPS``; a new request starts at the engine's recent
rate (``Acceptance.prior``) taken as at least ``PROBE_RATE`` until one of its drafts is
cut short (a pause that ends on a step without a draft probes at the row's next
draft). A verify is as wide as the batch's longest draft, so every row pays for it: a
verify may cost a row no more decode steps than its own drafts were expected to save
it, plus the steps it saves it by letting rows due to finish before it (no more
``max_tokens`` left) leave the batch sooner (``spec_cost.shared_tokens``: a batch of
fewer rows steps faster), plus ``spec_max_slowdown`` x the tokens it decoded
(``spec_cost.Credits``, settled after each verify: ``settle``), so a row with nothing to
copy is not slowed by its batch. While every row waits (a cool-down or a pause), the
step stays pipelined (``waiting``); so does a step whose drafts, looked up before the pending tokens are
read, would not pay (``presync``).

Drafts come from the request's own history first and its tenant's pool second
(``drafts.DraftPools``: when a request finishes, ``remember`` adds its output and the
last ``spec_pool_prompt_tokens`` of its prompt to the pool of ITS tenant, at most
``spec_pool_tokens`` tokens over all pools): a draft never comes from another tenant's
text. Counted per engine (``spec_*``; ``spec_pool_*`` for pool drafts) and per request
(``Usage.spec_drafted`` / ``spec_accepted``). ``Speculator.source`` replaces the draft
source (tests: drafts that are right, wrong or half right give the same tokens).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..serving_config import EngineConfig
from . import constrained, mlx_compat, spec_cost
from .drafts import DraftConfig, DraftPools, TenantDrafts, propose
from .spec_cost import FREE, Acceptance, CostModel, Credits, OnlineCost
from .spec_rows import Fills, RowIndexes

if TYPE_CHECKING:
    from .context import EngineCounters
    from .request import Request

# (request, k) -> up to k draft tokens following the request's sequence
DraftSource = Callable[["Request", int], Sequence[int]]
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
# EMPTY_SKIP + 1 steps (a copy starts at most EMPTY_SKIP tokens late; the steps between
# stay pipelined)
EMPTY_RUN = 4
EMPTY_SKIP = 2


class Speculator:
    def __init__(self, config: EngineConfig, counters: EngineCounters,
                 source: DraftSource | None = None, history: History | None = None,
                 cost: CostModel | None = None) -> None:
        self.max_k = config.spec_max_draft
        self.max_rows = config.spec_max_rows
        self.drafts_config = DraftConfig(min_n=config.spec_min_match,
                                         max_n=max(config.spec_min_match, 8),
                                         max_k=config.spec_max_draft,
                                         pool_tokens=config.spec_pool_tokens)
        self.pools = DraftPools(self.drafts_config)
        self.pool_prompt_tokens = config.spec_pool_prompt_tokens
        self.counters = counters
        self.source = source
        self.history = history
        # what a verify forward costs (measured at startup, or from the config; default:
        # what a decode step costs)
        self.cost: CostModel = cost if cost is not None else FREE
        self.clock: Callable[[], float] = time.perf_counter
        self._acc: dict[str, Acceptance] = {}  # request id -> its acceptance counts
        self._recent = Acceptance()  # every request's drafts: a new request's prior
        self._seeded: set[str] = set()  # tenants whose pool took the cache's history
        self._rows = RowIndexes(self.drafts_config)  # each request's own index
        self._k: dict[str, int] = {}
        # request id -> (steps left without drafts, the last cool-down length)
        self._cool: dict[str, tuple[int, int]] = {}
        # request id -> where its last draft came from ("self" | "pool" | "source")
        self._source: dict[str, str] = {}
        # request id -> (steps left without drafts, the pause's length) for rows whose
        # drafts did not pay; a row whose pause ran out probes (``_probing``)
        self._pause: dict[str, tuple[int, int]] = {}
        self._probing: set[str] = set()
        self._fills = Fills()  # rows whose draft this step is a fill (``fill``)
        # request id -> its draft this step looked up ``max_k`` long, where longer than
        # its own k; and the rows whose verified draft was extended so: their own length
        self._more: dict[str, tuple[int, ...]] = {}
        self._extended: dict[str, int] = {}
        # per request, the decode steps verifies saved it: what a verify may cost it
        self.credits = Credits(config.spec_max_slowdown)
        # per row of the verify the gate planned last, the tokens it expected, and the
        # price it planned with (``settle``)
        self._expected: list[float] = []
        self._price = 0.0
        # request id -> proposals in a row that found nothing; steps left without looking
        self._empty: dict[str, int] = {}
        self._skip: dict[str, int] = {}
        # a verify step's start and the seconds spent seeding tenant pools (a read of
        # the cache, not the step's own cost) by then (``step_started``)
        self._seeding_s = 0.0
        self._step: tuple[float, float] = (0.0, 0.0)

    def eligible(self, rows: Sequence[Request], cache: Sequence[Any], model: Any) -> bool:
        """A verify forward can serve these rows: at most ``max_rows``, caches whose
        rejected positions can be taken back (``mlx_compat.speculation_kind``), no logits
        processors or hook; several rows over array states that cannot take right padding
        (``mlx_compat.states_take_lengths``) keep as many positions as the shortest, so
        they must all be greedy (a sampled row's key would have advanced past them)."""
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
        # a batch size the guard paused (spec_guard) decodes as without speculation; its
        # rows' own cool-downs and pauses go on counting the steps
        if isinstance(self.cost, OnlineCost) and not self.cost.allows(len(rows)):
            for r in rows:
                self._tick(r)
            return False
        return True

    def waiting(self, rows: Sequence[Request]) -> bool:
        """Every row cools down or pauses this step: count the step for each and say
        so (the batch then decodes without reading its pending tokens first)."""
        if not all(self._waits(r) for r in rows):
            return False
        for r in rows:
            self._tick(r)
        return True

    def _waits(self, r: Request) -> bool:
        rid = r.request_id
        return self._cool.get(rid, (0, 0))[0] > 0 or self._pause.get(rid, (0, 0))[0] > 0 \
            or self._skip.get(rid, 0) > 0

    def _tick(self, r: Request) -> bool:
        """One step of ``r``'s cool-down or pause passes; True if it was in one."""
        rid = r.request_id
        rest = self._cool.get(rid, (0, 0))
        if rest[0] > 0:
            self._cool[rid] = (rest[0] - 1, rest[1])
            return True
        paused = self._pause.get(rid, (0, 0))
        if paused[0] > 0:
            self._pause[rid] = (paused[0] - 1, paused[1])
            if paused[0] == 1:
                self._probing.add(rid)
            return True
        skip = self._skip.get(rid, 0)
        if skip > 0:
            self._skip[rid] = skip - 1
            return True
        return False

    def propose(self, r: Request) -> tuple[int, ...]:
        """Draft tokens after ``r``'s sequence (prompt + output so far); none while the
        request cools down after a fully rejected draft or pauses after drafts that did
        not pay."""
        if self._tick(r):
            return ()
        k = self._k.setdefault(r.request_id, max(MIN_K, self.max_k // 2))
        # looked up ``max_k`` long: what lies past ``k`` may extend the draft into the
        # positions a wider verify pads anyway (``plan``)
        if self.source is not None:
            self._source[r.request_id] = "source"
            tokens = tuple(int(t) for t in self.source(r, self.max_k))[:self.max_k]
        else:
            draft = propose(self._rows.synced(r), self._pool(r.req.tenant), self.max_k)
            self._source[r.request_id] = draft.source
            self._rows.drafted(r.request_id, draft.at)
            tokens = draft.tokens
            if tokens:
                self._empty[r.request_id] = 0
            else:  # nothing to copy here: after EMPTY_RUN such steps, look less often
                empty = self._empty[r.request_id] = self._empty.get(r.request_id, 0) + 1
                if empty >= EMPTY_RUN:
                    self._skip[r.request_id] = EMPTY_SKIP
        if len(tokens) > k and not r.processors:
            self._more[r.request_id] = tokens
        return self._grammar_cut(r, tokens[:k])

    def fill(self, r: Request, k: int) -> tuple[int, ...]:
        """A draft for a row that drafts nothing this step, for the positions a verify
        pads anyway (``spec_rows.Fills``): no cool-down, pause or skip is counted."""
        if r.processors or k <= 0:
            return ()
        if self.source is not None:
            return tuple(int(t) for t in self.source(r, k))[:k]
        draft = propose(self._rows.synced(r), self.pools.get(r.req.tenant), k)
        self._rows.drafted(r.request_id, draft.at)
        return draft.tokens

    def _grammar_cut(self, r: Request, draft: tuple[int, ...]) -> tuple[int, ...]:
        """A constrained row's draft up to the first token its grammar rejects after the
        pending token (``r.output[-1]``, reported, not yet fed)."""
        if not r.processors or not draft:
            return draft
        n = constrained.grammar_prefix(r.processors, r.output[-1], draft)
        self.counters.spec_grammar_cut += len(draft) - n
        return draft[:n]

    def _pool(self, tenant: str) -> TenantDrafts | None:
        """``tenant``'s pool; the first time a tenant asks in this process, it is
        seeded with the token ids the cache stores for it (RAM, SSD, Redis: drafts
        survive a restart and are shared between servers), at most the pool's budget."""
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

    def feedback(self, r: Request, drafted: int, accepted: int) -> None:
        c = self.counters
        c.spec_verifies += 1
        c.spec_drafted += drafted
        c.spec_accepted += accepted
        self._rows.verified(r.request_id, accepted)
        if self._fills.verified(r, c, drafted, accepted):
            if accepted:  # back in sync: its cool-down ends
                self._cool[r.request_id] = (0, 0)
            return
        own = self._extended.pop(r.request_id, drafted)
        if own < drafted:
            # the extension past the row's own draft was verified in padding: counted
            # as a fill; the row's rate, k and cool-down see its own draft only
            self._fills.count(r, c, drafted - own, max(0, accepted - own))
            drafted, accepted = own, min(accepted, own)
        if self._source.get(r.request_id) == "pool":
            c.spec_pool_drafted += drafted
            c.spec_pool_accepted += accepted
        r.usage.spec_drafted += drafted
        r.usage.spec_accepted += accepted
        self._acceptance(r).update(drafted, accepted)
        self._recent.update(drafted, accepted)
        k = self._k.get(r.request_id, self.max_k)
        self._k[r.request_id] = min(self.max_k, 2 * k) if accepted == drafted \
            else max(MIN_K, accepted + 1)
        # a fully rejected draft: no drafts for 1, 2, 4, ... MAX_COOL steps in a row
        _, last = self._cool.get(r.request_id, (0, 0))
        if accepted == 0:
            wait = min(MAX_COOL, 2 * last if last else 1)
            self._cool[r.request_id] = (wait, wait)
        else:
            self._cool[r.request_id] = (0, 0)
            self._pause.pop(r.request_id, None)  # drafts pay again: a later pause starts short

    def plan(self, rows: Sequence[Request], drafts: list[Sequence[int]],
             cache: Sequence[Any], model: Any) -> int:
        """How many tokens of its draft each row feeds in a verify forward, 0: decode as
        usual (``spec_cost.plan``: each row's acceptance rate, the measured cost of the
        verify forward, the forward that feeds array states again). A row whose draft
        does not pay on its own has it emptied in ``drafts`` and pauses."""
        if not any(drafts):  # a sync and drafting for nothing, as a gated step
            self._gated(len(rows), idle=True)
            return 0
        cut, lengths, fills, dropped, (self._expected, self._price) = self._decide(
            rows, drafts, cache, model, self.fill)
        self._drop(rows, dropped, drafts)
        more = self._more  # this step's (cleared when the next starts)
        if cut:
            for i, n in enumerate(lengths):
                rid = rows[i].request_id
                if i in fills:
                    drafts[i] = fills[i]
                    self._fills.rows.add(rid)
                elif n == 0 and drafts[i]:
                    drafts[i] = ()
                elif 0 < n < cut and len(more.get(rid, ())) > n:
                    # the verify is ``cut`` wide for this row anyway: its draft goes on
                    # there (the row's own gate, k and rate count its first n tokens)
                    self._extended[rid] = n
                    drafts[i] = more[rid][:cut]
        else:
            self._gated(len(rows))
        return cut

    def _decide(self, rows: Sequence[Request], drafts: Sequence[Sequence[int]],
                cache: Sequence[Any], model: Any,
                fill: Callable[[Request, int], tuple[int, ...]]
                ) -> tuple[int, list[int], dict[int, tuple[int, ...]], list[int],
                     tuple[list[float], float]]:
        """The gate's decision alone: ``(cut, each row's draft length, the fills (row ->
        its fill), the rows whose own draft does not pay on its own, (what the verify is
        expected to be worth to each row at the cut: its tokens and the steps the other
        rows' gains save it, ``spec_cost.shared_tokens``; the verify's price: empty and
        0 when the cut is 0))``; no fill is looked up when no row's own draft pays (the
        cut is then 0)."""
        state = mlx_compat.speculation_kind(cache) == "state"
        uniform = state and len(rows) > 1 and not mlx_compat.states_take_lengths(model)
        rates = [self._rate(r) for r in rows]
        lengths = [len(d) for d in drafts]
        dropped = [i for i, n in enumerate(lengths)
                   if n and not spec_cost.row_pays(rates[i], n, self.cost, len(rows))]
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
        share = spec_cost.row_share(self.cost, len(rows), max(r.pos for r in rows))
        left = [r.req.sampling.max_tokens - len(r.output) for r in rows]
        cut = spec_cost.plan(rates, lengths, self.cost, state=state, uniform=uniform,
                             allowance=allowance, share=share, left=left)
        if not cut:
            return 0, lengths, fills, dropped, ([], 0.0)
        expected = spec_cost.row_tokens(rates, lengths, cut, uniform=uniform)
        price = spec_cost.verify_price(rates, lengths, cut, self.cost, state=state,
                                       tokens=sum(expected))
        return cut, lengths, fills, dropped, (
            spec_cost.shared_tokens(expected, share, left), price)

    def _drop(self, rows: Sequence[Request], dropped: Sequence[int],
              drafts: Sequence[Sequence[int]]) -> None:
        """Rows whose drafts did not pay pause; the probe of every row that drafted is
        spent (a row whose pause ended this step drafts next step: it probes then)."""
        for i in dropped:
            self._hold(rows[i])
        for r, d in zip(rows, drafts, strict=True):
            if d:
                self._probing.discard(r.request_id)

    def presync(self, rows: Sequence[Request], cache: Sequence[Any], model: Any,
                reported: Sequence[bool]) -> bool:
        """Before the pending tokens are read (the sync that ends the decode pipeline):
        would the gate verify the drafts the rows' sequences give without them (each
        looked up one token longer, its first token standing for the pending one;
        ``reported``: rows whose pending token is in their output already)? No:
        the step decodes pipelined, every row's cool-down, pause or skip counts it, and
        the rows whose drafts did not pay pause, as after a gated step
        (``spec_presync_gated``); the guard counts nothing. Drafts from the request's
        own history and its pool only (a ``source`` is asked after the sync)."""
        if self.source is not None:
            return True
        ahead = {r.request_id: not known for r, known in zip(rows, reported, strict=True)}
        drafts = [() if self._waits(r) else self._ahead(r, self._k.get(
            r.request_id, max(MIN_K, self.max_k // 2)), ahead[r.request_id]) for r in rows]
        if any(drafts):
            cut, _, _, dropped, _ = self._decide(
                rows, drafts, cache, model,
                lambda r, k: () if r.processors else self._ahead(r, k, ahead[r.request_id]))
            if cut:
                return True
        else:
            dropped = []
        for r in rows:
            self._tick(r)
        self._drop(rows, dropped, drafts)
        self.counters.spec_presync_gated += 1
        return False

    def _ahead(self, r: Request, k: int, ahead: bool = True) -> tuple[int, ...]:
        """Up to ``k`` tokens after the pending one, drafted before it is read
        (``ahead``; else it is the sequence's last)."""
        tokens = propose(self._rows.synced(r), self._pool(r.req.tenant), k + int(ahead)).tokens
        return tokens[1:] if ahead else tokens

    def _gated(self, rows: int, *, idle: bool = False) -> None:
        """A step that read the pending tokens and drafted for no verify: gated (counted
        ``spec_gated``), or ``idle`` (no row found a draft)."""
        self.counters.spec_gated += not idle
        if isinstance(self.cost, OnlineCost):
            before = self.cost.guard.gated_off
            self.cost.observe_gated(rows, idle=idle)
            self.counters.spec_guard_off += self.cost.guard.gated_off - before

    def _rate(self, r: Request) -> float:
        """``r``'s acceptance rate for the gate: at least ``PROBE_RATE`` while it probes
        (after a pause) and until a draft of its own is cut short (a first draft accepted
        whole is no evidence against copying: the decayed counts would put a row that
        accepted 2 of 2 at 0.81, below where it started, and a batch of such rows, all
        copying, would stop verifying)."""
        acc = self._acceptance(r)
        return max(acc.rate, PROBE_RATE) \
            if r.request_id in self._probing or not acc.cut_short else acc.rate

    def _hold(self, r: Request) -> None:
        """``r``'s drafts do not pay: no drafts for ``PROBE_STEPS`` steps, twice as many
        as last time while no verify since accepted a token (at most
        ``MAX_PROBE_STEPS``)."""
        rid = r.request_id
        _, last = self._pause.get(rid, (0, 0))
        wait = min(MAX_PROBE_STEPS, 2 * last) if last else PROBE_STEPS
        self._pause[rid] = (wait, wait)
        self.counters.spec_paused += 1

    def observe_decode(self, rows: int, seconds: float, context: int) -> None:
        """A plain decode step of ``rows`` rows over ``context`` tokens (the longest
        row's) took ``seconds`` (``OnlineCost``)."""
        if isinstance(self.cost, OnlineCost):
            self.cost.observe_decode(rows, seconds, context)

    def observe_verify(self, rows: int, width: int, seconds: float, context: int) -> None:
        """A verify forward of ``rows`` x ``width`` positions over ``context`` tokens
        took ``seconds``."""
        if isinstance(self.cost, OnlineCost):
            self.cost.observe_verify(rows, width, seconds, context)

    def settle(self, rows: Sequence[Request]) -> None:
        """The verify of ``rows`` that the gate planned last (``plan``) ran: each row's
        credit (``spec_cost.Credits``) gains what the gate expected it to be worth to
        the row (its tokens and the steps the other rows' gains save it), less the price
        it planned with (``spec_cost.verify_price``). Expected, not
        the tokens it gave: the bound is on what other rows' verifies cost a row, not on
        the luck of its own drafts (``row_pays`` judges those); planned, not re-measured
        by this verify: a row stays within the allowance the gate planned for."""
        for r, e in zip(rows, self._expected, strict=True):
            self.credits.settle(r.request_id, e, self._price)

    def step_started(self) -> None:
        """A verify step begins (before its drafts): ``step_done`` times it whole."""
        self._step = (self.clock(), self._seeding_s)
        self._more.clear()

    def step_done(self, rows: int, width: int, tokens: int, context: int) -> None:
        """The verify step begun last gave ``tokens`` tokens over ``rows`` rows and
        ``context`` tokens: its wall time, less any pool seeding in it, goes to the
        guard (``StepGuard``)."""
        if isinstance(self.cost, OnlineCost):
            t0, seeding = self._step
            before = self.cost.guard.turned_off
            self.cost.observe_step(rows, width, tokens,
                                   self.clock() - t0 - (self._seeding_s - seeding), context)
            self.counters.spec_guard_off += self.cost.guard.turned_off - before

    def _acceptance(self, r: Request) -> Acceptance:
        acc = self._acc.get(r.request_id)
        if acc is None:
            acc = self._acc[r.request_id] = self._recent.prior()
        return acc

    def remember(self, r: Request) -> None:
        """A finished request's output and the last ``pool_prompt_tokens`` of its prompt
        join its tenant's pool (engine thread)."""
        if not r.output or self.drafts_config.pool_tokens == 0:
            return
        start = max(0, r.n_prompt - self.pool_prompt_tokens)
        self.pools.add(r.req.tenant,
                       [int(t) for t in r.seq[start:r.n_prompt + len(r.output)].tolist()])

    def pool_tokens(self) -> int:
        return self.pools.num_tokens()

    def forget(self, r: Request) -> None:
        self._rows.forget(r.request_id)
        self._k.pop(r.request_id, None)
        self._cool.pop(r.request_id, None)
        self._source.pop(r.request_id, None)
        self._acc.pop(r.request_id, None)
        self._pause.pop(r.request_id, None)
        self._probing.discard(r.request_id)
        self._empty.pop(r.request_id, None)
        self._skip.pop(r.request_id, None)
        self._fills.rows.discard(r.request_id)
        self._more.pop(r.request_id, None)
        self._extended.pop(r.request_id, None)
        self.credits.forget(r.request_id)

