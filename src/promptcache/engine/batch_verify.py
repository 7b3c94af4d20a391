"""Speculative decoding's verify step of a decode batch: one forward of every row's draft.

``DecodeBatch.step`` hands a step to ``verify_step`` when the speculator takes it
(``speculate.py`` drafts and gates); the caches are then repaired to hold exactly the
positions each row keeps (``repair``, through ``mlx_compat``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx

from ..errors import InvariantError
from . import mlx_compat
from .sampling import logprob_values

if TYPE_CHECKING:
    from .batch import DecodeBatch
    from .speculate import Speculator


def verify_step(batch: DecodeBatch, spec: Speculator) -> bool:
    """Every row's pending token and its draft (``speculate.py``) in one forward of
    ``[rows, 1 + longest draft]`` (shorter drafts padded at the right). Synchronous
    (no pipelining). Per row, the longest draft prefix that decoding one token at a
    time would produce is kept plus the model's token after it; the caches are then
    repaired to hold exactly the positions each row keeps (``repair``). A stop
    string or max_tokens inside an accepted draft ends the row there, its caches
    holding prompt + output[:-1], as without speculation. False: no verify is worth
    it, the caller decodes as usual (the pending tokens have been reported then)."""
    inputs = batch.pending
    if inputs is None:  # step() checks it; a row without a pending token is a bug
        raise InvariantError("a speculative step over rows without pending tokens")
    pending = cast(list[int], inputs.tolist())
    # the pending tokens are reported before they are fed: a stop here saves the
    # state as it is (prompt + output[:-1])
    done: set[int] = set()
    for i, r in enumerate(batch.rows):
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
            return True
    rows = batch.rows
    spec.step_started()
    drafts: list[Sequence[int]] = [spec.propose(r) for r in rows]
    cut = spec.plan(rows, drafts, batch.cache, batch.model)
    if cut == 0:
        return False
    # the verify's wall time, for the gate's online cost: the forward and reading its
    # tokens (the sync the step does anyway); not the drafting (a tenant pool's first
    # seeding reads the cache)
    t0 = spec.clock()
    context = batch.context()  # compared with plain steps over as many tokens
    drafts = [d[:cut] for d in drafts]
    width = 1 + max(len(d) for d in drafts)
    x = mx.array([[pending[i], *d, *([pending[i]] * (width - 1 - len(d)))]
                  for i, d in enumerate(drafts)], dtype=mx.uint32)
    states = mlx_compat.before_verify(batch.cache)
    logits = batch.model(x, cache=batch.cache)
    greedy: list[list[int]] = []
    if any(r.sampler.greedy for r in rows):
        greedy = cast(list[list[int]], mx.argmax(logits, axis=-1).tolist())
    accepted: list[int] = []
    bonus: list[int] = []
    # constrained rows: the logits at each position checked, masked by the grammar
    masked: dict[int, list[mx.array]] = {}
    for i, r in enumerate(rows):
        d, a = drafts[i], 0
        if r.processors:
            # the grammar masks position j once the draft tokens before it were
            # accepted (its matcher consumes exactly what the reply keeps), then the
            # token is picked as decoding one at a time would (sample: argmax if greedy)
            fed, masked[i] = pending[i], []
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
            # each position sampled in order with the request's own key, as decoding
            # one token at a time would: a draft token counts only if it IS that sample
            while True:
                tok = int(cast(int, r.sampler.sample(logits[i, a]).item()))
                if a < len(d) and tok == d[a]:
                    a += 1
                    continue
                break
        accepted.append(a)
        bonus.append(tok)
    spec.observe_verify(len(rows), width, spec.clock() - t0, context)
    batch.clear_decode_timing()  # the next plain step's read finds nothing in flight
    # array states that cannot take right-padded tokens (mlx_compat.states_take_lengths):
    # every row keeps as many positions as the shortest (greedy rows only: eligible)
    uniform = states is not None and len(rows) > 1 \
        and not mlx_compat.states_take_lengths(batch.model)
    if uniform:
        cap = min(accepted)
        accepted = [min(a, cap) for a in accepted]
        bonus = [greedy[i][a] for i, a in enumerate(accepted)]
    for i, r in enumerate(rows):
        if drafts[i]:
            spec.feedback(r, len(drafts[i]), accepted[i])
    c = rows[0].ctx.counters  # the step itself is counted by the scheduler (decode_steps)
    c.spec_multirow += len(rows) > 1
    # report the accepted draft tokens; a row that stops inside its draft keeps the
    # positions fed before its last token (prompt + output[:-1])
    kept: list[int] = []
    stopped: dict[int, str] = {}
    for i, r in enumerate(rows):
        n = 1 + accepted[i]
        wants = r.sampler.wants_logprobs
        at = masked.get(i)
        for j, tok in enumerate(drafts[i][:accepted[i]]):
            values = logprob_values(r.sampler.logprob_arrays(
                logits[i, j] if at is None else at[j], mx.array(int(tok)))) \
                if wants else None
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
    repair(batch, x, states, held)
    spec.settle(rows)
    bs = batch.block_size
    for i, r in enumerate(rows):
        before = r.pos
        r.pos += kept[i]
        if i in stopped:
            exact = held[i] == kept[i]
            if not exact:
                c.spec_unsaved += 1
            r.finish(stopped[i], batch.row_caches(i) if exact else None,
                     state_pos=r.pos)
        elif r.sliding and r.pos // bs > before // bs:
            # a sliding window drops old tokens: store output blocks while in it
            r.store_decoded_block(batch.row_caches(i))
    # the model's own token after each accepted draft: fed and reported next step
    batch.set_pending(mx.array(bonus, dtype=mx.uint32), lps)
    spec.step_done(len(rows), width, sum(kept), context)
    if stopped:
        batch.remove(set(stopped))
    return True


def repair(batch: DecodeBatch, x: mx.array, states: list[list[Any]] | None,
           kept: Sequence[int]) -> int:
    """After a verify forward of ``x``: row ``i`` keeps its first ``kept[i]``
    positions. KV and sliding windows drop the rest (``mlx_compat.drop_row_tails``).
    Array states (SSM, linear attention) absorbed every position fed: unless every
    row keeps all of them, the states go back to before the verify
    (``states``), the KV leaves drop the whole verify, and the kept positions are
    fed again, right-padded (``lengths``: padding never reaches a state), so each
    state holds exactly its row's kept tokens; the KV leaves' pad tails then take
    rows' first positions (``mlx_compat.finalize_refeed``, recorded in ``RowMoves``).
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
    batch.rows[0].ctx.counters.spec_recomputes += 1
    return max(kept)
