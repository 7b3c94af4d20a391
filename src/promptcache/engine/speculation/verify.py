"""The verify step of a decode batch, in the two calls the batch makes: ``plan_verify``
(the pending tokens reported, every row's draft, the gate; the forward's input) and,
after the batch's forward of it, ``apply_verify`` (per row the longest draft prefix
decoding one token at a time would produce, plus the model's token after it; the caches
repaired to hold exactly what each row keeps, ``repair``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import mlx.core as mx

from ...errors import InvariantError
from .. import mlx_compat
from ..sampling import logprob_values
from .speculator import Speculator
from .state import Row

LogprobArrays = tuple[mx.array, ...]


class Batch(Protocol):
    """What the verify step uses of the decode batch (``engine.requests.batch.DecodeBatch``)."""

    @property
    def rows(self) -> Sequence[Row]: ...
    @property
    def cache(self) -> list[Any]: ...
    @property
    def model(self) -> Any: ...
    @property
    def block_size(self) -> int: ...
    @property
    def pending(self) -> mx.array | None: ...
    @property
    def reported(self) -> list[bool]: ...

    def take_unreported(self, i: int) -> tuple[LogprobArrays | None, mx.array | None] | None: ...
    def take_decode_timing(self) -> tuple[int, float, int] | None: ...
    def clear_decode_timing(self) -> None: ...
    def row_caches(self, i: int, before: list[list[Any]] | None = None) -> list[Any]: ...
    def moves(self) -> list[mlx_compat.RowMoves]: ...
    def remove(self, drop: set[int]) -> None: ...
    def context(self) -> int: ...
    def set_pending(self, tokens: mx.array, lps: list[LogprobArrays | None],
                    logits: list[mx.array | None] | None = None) -> None: ...


@dataclass
class VerifyPlan:
    """A verify the gate took: the forward's input ``x`` (``[rows, width]``) and what
    ``apply_verify`` needs to judge its logits."""

    x: mx.array
    rows: list[Row]
    pending: list[int]
    drafts: list[Sequence[int]]
    states: list[list[Any]] | None
    width: int
    context: int
    t0: float


def plan_verify(spec: Speculator, batch: Batch) -> VerifyPlan | None:
    """The step is a verify (its forward's input), or None: the batch decodes as usual
    (its pending tokens may have been reported, and rows that stopped removed)."""
    timed = batch.take_decode_timing()
    if timed is not None:
        spec.observe_decode(*timed)
    rows = batch.rows
    if not (spec.eligible(rows, batch.cache, batch.model) and not spec.waiting(rows)
            and spec.presync(rows, batch.cache, batch.model, batch.reported)):
        return None
    inputs = batch.pending
    if inputs is None:  # the batch checks it; a row without a pending token is a bug
        raise InvariantError("a speculative step over rows without pending tokens")
    pending = cast(list[int], inputs.tolist())
    # the pending tokens are reported before they are fed: a stop here saves the
    # state as it is (prompt + output[:-1])
    done: set[int] = set()
    for i, r in enumerate(rows):
        unreported = batch.take_unreported(i)
        if unreported is None:
            continue
        lp, row_logits = unreported
        reason = r.accept(pending[i], logprob_values(lp) if lp is not None else None,
                          row_logits)
        if reason is not None:
            r.finish(reason, batch.row_caches(i), state_pos=r.pos)
            done.add(i)
    if done:
        pending = [p for i, p in enumerate(pending) if i not in done]
        batch.remove(done)
        if not batch.rows:
            return None
    rows = list(batch.rows)
    spec.step_started()
    drafts: list[Sequence[int]] = [spec.propose(r) for r in rows]
    cut = spec.plan(rows, drafts, batch.cache, batch.model)
    if cut == 0:
        return None
    # the verify's wall time, for the gate's online cost: the forward and reading its
    # tokens; not the drafting (a tenant pool's first seeding reads the cache)
    t0 = spec.clock()
    context = batch.context()  # compared with plain steps over as many tokens
    drafts = [d[:cut] for d in drafts]
    width = 1 + max(len(d) for d in drafts)
    x = mx.array([[pending[i], *d, *([pending[i]] * (width - 1 - len(d)))]
                  for i, d in enumerate(drafts)], dtype=mx.uint32)
    return VerifyPlan(x, rows, pending, drafts, mlx_compat.before_verify(batch.cache),
                      width, context, t0)


def _accepted(rows: Sequence[Row], p: VerifyPlan, logits: mx.array
              ) -> tuple[list[int], list[int], list[list[int]], dict[int, list[mx.array]]]:
    """Per row, the draft tokens accepted and the model's token after them (the greedy
    picks, and a constrained row's masked logits at each position checked)."""
    greedy: list[list[int]] = []
    if any(r.sampler.greedy for r in rows):
        greedy = cast(list[list[int]], mx.argmax(logits, axis=-1).tolist())
    accepted: list[int] = []
    bonus: list[int] = []
    masked: dict[int, list[mx.array]] = {}
    for i, r in enumerate(rows):
        d, a = p.drafts[i], 0
        if r.processors:
            # the grammar masks position j once the draft tokens before it were
            # accepted (its matcher consumes exactly what the reply keeps)
            fed, masked[i] = p.pending[i], []
            while True:
                row = r.process(logits[i, a], mx.array([fed], dtype=mx.uint32))
                masked[i].append(row)
                tok = int(cast(int, r.sampler.sample(row).item()))
                if a < len(d) and tok == d[a]:
                    fed = d[a]
                    a += 1
                    continue
                break
        elif r.sampler.greedy:
            while a < len(d) and greedy[i][a] == d[a]:
                a += 1
            tok = greedy[i][a]
        else:
            # each position sampled in order with the request's own key: a draft token
            # counts only if it IS that sample
            while True:
                tok = int(cast(int, r.sampler.sample(logits[i, a]).item()))
                if a < len(d) and tok == d[a]:
                    a += 1
                    continue
                break
        accepted.append(a)
        bonus.append(tok)
    return accepted, bonus, greedy, masked


def apply_verify(spec: Speculator, batch: Batch, p: VerifyPlan, logits: mx.array) -> None:
    """The verify forward of ``p.x`` gave ``logits``: accept, report, repair, finish."""
    rows = p.rows
    accepted, bonus, greedy, masked = _accepted(rows, p, logits)
    spec.observe_verify(len(rows), p.width, spec.clock() - p.t0, p.context)
    batch.clear_decode_timing()  # the next plain step's read finds nothing in flight
    # array states that cannot take right-padded tokens: every row keeps as many
    # positions as the shortest (greedy rows only: ``Speculator.eligible``)
    uniform = p.states is not None and len(rows) > 1 \
        and not mlx_compat.states_take_lengths(batch.model)
    if uniform:
        cap = min(accepted)
        accepted = [min(a, cap) for a in accepted]
        bonus = [greedy[i][a] for i, a in enumerate(accepted)]
    for i, r in enumerate(rows):
        if p.drafts[i]:
            spec.feedback(r, len(p.drafts[i]), accepted[i])
    c = spec.counters
    c.spec_multirow += len(rows) > 1
    # report the accepted draft tokens; a row that stops inside its draft keeps the
    # positions fed before its last token (prompt + output[:-1])
    kept: list[int] = []
    stopped: dict[int, str] = {}
    for i, r in enumerate(rows):
        n = 1 + accepted[i]
        at = masked.get(i)
        for j, tok in enumerate(p.drafts[i][:accepted[i]]):
            values = logprob_values(r.sampler.logprob_arrays(
                logits[i, j] if at is None else at[j], mx.array(int(tok)))) \
                if r.sampler.wants_logprobs else None
            reason = r.accept(int(tok), values, None)
            if reason is not None:
                stopped[i] = reason
                n = j + 1
                break
        kept.append(n)
    lps = [r.sampler.logprob_arrays(logits[i, accepted[i]] if i not in masked
                                    else masked[i][accepted[i]], mx.array(bonus[i]))
           if r.sampler.wants_logprobs and i not in stopped else None
           for i, r in enumerate(rows)]
    # uniform: rows that stopped before the others' end hold more than their output
    # (an array state cannot give it back): they finish without the end save
    held = [1 + accepted[i] for i in range(len(rows))] if uniform else kept
    if repair(batch, p.x, p.states, held):
        c.spec_recomputes += 1
    spec.settle(rows)
    bs = batch.block_size
    for i, r in enumerate(rows):
        before = r.pos
        r.pos += kept[i]
        if i in stopped:
            exact = held[i] == kept[i]
            if not exact:
                c.spec_unsaved += 1
            r.finish(stopped[i], batch.row_caches(i) if exact else None, state_pos=r.pos)
        elif r.sliding and r.pos // bs > before // bs:
            # a sliding window drops old tokens: store output blocks while in it
            r.store_decoded_block(batch.row_caches(i))
    # the model's own token after each accepted draft: fed and reported next step
    batch.set_pending(mx.array(bonus, dtype=mx.uint32), lps)
    spec.step_done(len(rows), p.width, sum(kept), p.context)
    if stopped:
        batch.remove(set(stopped))


def repair(batch: Batch, x: mx.array, states: list[list[Any]] | None,
           kept: Sequence[int]) -> int:
    """After a verify forward of ``x``, row ``i`` keeps its first ``kept[i]`` positions.
    KV and sliding windows drop the rest. Array states (SSM) go back to before the
    verify, the KV leaves drop the whole verify and the kept positions are fed again,
    right-padded (``mlx_compat.finalize_refeed`` records where rows' positions moved).
    Returns the width of that second forward (0: none)."""
    width = int(x.shape[1])
    if states is None:
        mlx_compat.drop_row_tails(batch.cache, [width - n for n in kept], batch.moves())
        return 0
    if all(n == width for n in kept):
        return 0
    mlx_compat.restore_before_verify(batch.cache, states, width)
    mlx_compat.prepare_right_padded(batch.cache, kept)
    batch.model(x[:, :max(kept)], cache=batch.cache)
    mlx_compat.finalize_refeed(batch.cache, batch.moves())
    return max(kept)
