"""Batched decode: every decoding request advances in one forward per step.

``DecodeBatch`` holds the decoding rows and mlx-lm's batch caches (``BatchKVCache``,
``BatchRotatingKVCache``, ``ArraysCache``, ``CacheList``; merged from each request's
own caches when it joins, compacted with ``filter`` when it leaves). A step is
pipelined as in mlx-lm's generate loop:

    launch step k: feed the tokens sampled at step k-1, sample per row (each with its
        own key, processors, log-probabilities), ``mx.async_eval``
    meanwhile, on the host: report the step k-1 tokens to their requests (stop ids,
        stop strings, max_tokens, events), save, remove the finished rows

so host work overlaps the next forward. A row that finishes had its last token fed
already; its end-of-generation save still stores prompt + output[:-1] (KV layers
are sliced; array states, SSM, are taken from before the step: ``ssm_states``).
What leaves the batch for the cache is read through ``mlx_compat.row_caches``: views
sliced and copied block by block, copies of windows and states -- never rows of the
live batch, which ``filter`` / ``extend`` rebuild and later steps write.

``decode_alone`` is the per-request path for caches mlx-lm cannot batch (quantized
KV, sliding windows that keep tokens): one forward per request per step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx

from ..errors import InvariantError
from . import mlx_compat
from .request import Request
from .sampling import logprob_values

if TYPE_CHECKING:
    from .speculate import Speculator

logger = logging.getLogger(__name__)

LogprobArrays = tuple[mx.array, ...]


class DecodeBatch:
    """The rows decoding together and their batch caches."""

    def __init__(self, model: Any, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.rows: list[Request] = []
        self.cache: list[Any] = []
        # per row: the token to feed next (sampled last step, or the first token of a
        # row that just joined), whether it was reported already, and its logprobs
        self._inputs: mx.array | None = None
        self._reported: list[bool] = []
        self._lps: list[LogprobArrays | None] = []
        self._logits: list[mx.array | None] = []  # for the logits hook (tests)
        self.non_truncatable = False
        # speculation's online cost (Speculator.observe_*): when the last plain step read
        # its fed tokens (the forward before it done) and how many rows its forward had
        self._synced: tuple[float, int] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def nbytes(self) -> int:
        return mlx_compat.batch_nbytes(self.cache) if self.rows else 0

    # ------------------------------------------------------------------ membership

    def join(self, req: Request, token: int) -> None:
        """Add a request whose prefill is done (its caches hold ``req.pos`` tokens and
        ``token``, its first output token, was reported already)."""
        merged = [mlx_compat.merge([c]) for c in req.caches]
        if not self.rows:
            self.cache = merged
        else:
            for mine, theirs in zip(self.cache, merged, strict=True):
                mlx_compat.extend(mine, theirs)
        req.caches = []
        tok = mx.array([token], dtype=mx.uint32)
        self._inputs = tok if self._inputs is None else mx.concatenate([self._inputs, tok])
        self.rows.append(req)
        self._reported.append(True)
        self._lps.append(None)
        self._logits.append(None)
        self.non_truncatable = self.non_truncatable or not req.truncatable

    def join_batch(self, reqs: Sequence[Request], tokens: Sequence[int], cache: list[Any]
                   ) -> None:
        """Add several requests at once: ``cache`` holds exactly their rows (a batch
        cache per layer, row ``i`` = ``reqs[i]``, prompt done, first token reported)."""
        if not reqs:
            return
        if not self.rows:
            self.cache = cache
        else:
            for mine, theirs in zip(self.cache, cache, strict=True):
                mlx_compat.extend(mine, theirs)
        tok = mx.array(list(tokens), dtype=mx.uint32)
        self._inputs = tok if self._inputs is None else mx.concatenate([self._inputs, tok])
        for r in reqs:
            r.caches = []
            self.rows.append(r)
            self._reported.append(True)
            self._lps.append(None)
            self._logits.append(None)
            self.non_truncatable = self.non_truncatable or not r.truncatable

    def _remove(self, drop: set[int]) -> None:
        for i in drop:
            spec = self.rows[i].ctx.speculator
            if spec is not None:
                spec.forget(self.rows[i])
        keep = [i for i in range(len(self.rows)) if i not in drop]
        if not keep:
            self.rows, self.cache, self._inputs = [], [], None
            self._reported, self._lps, self._logits = [], [], []
            self.non_truncatable = False
            self._synced = None
            return
        for c in self.cache:
            mlx_compat.filter_rows(c, keep)
        if self._inputs is not None:
            self._inputs = self._inputs[mx.array(keep)]
        self.rows = [self.rows[i] for i in keep]
        self._reported = [self._reported[i] for i in keep]
        self._lps = [self._lps[i] for i in keep]
        self._logits = [self._logits[i] for i in keep]

    def drop_cancelled(self) -> None:
        """Finish the rows whose client went away (before the next forward)."""
        gone = {i for i, r in enumerate(self.rows) if r.cancelled}
        if not gone:
            return
        for i in sorted(gone):
            r = self.rows[i]
            # the state holds every reported token: KV layers are sliced to prompt +
            # output[:-1] as always; array states (SSM) are stored where they are
            pos = r.n_prompt + len(r.output) - 1 if r.truncatable else r.pos
            r.finish("cancelled", mlx_compat.row_caches(self.cache, i), state_pos=pos)
        self._remove(gone)

    def fail_all(self, error: str) -> None:
        for r in self.rows:
            r.fail(error)
        self._remove(set(range(len(self.rows))))

    # ------------------------------------------------------------------ the step

    def step(self) -> None:
        """One batched forward (launched asynchronously), then the host work of the
        previous step's tokens; or, for a row the speculator takes, one verify forward
        of its draft (``_speculative_step``)."""
        if not self.rows or self._inputs is None:
            return
        spec = self.rows[0].ctx.speculator
        if spec is not None and spec.eligible(self.rows, self.cache, self.model) \
                and not spec.waiting(self.rows) and self._speculative_step(spec):
            return
        rows = self.rows
        inputs = self._inputs
        before = mlx_compat.ssm_states(self.cache) if self.non_truncatable else None
        logits = self.model(inputs[:, None], cache=self.cache)[:, -1, :]
        greedy = mx.argmax(logits, axis=-1)
        toks: list[mx.array] = []
        lps: list[LogprobArrays | None] = []
        for i, r in enumerate(rows):
            # a row whose pending token is its last (max_tokens) needs no real sample
            last = not self._reported[i] and len(r.output) + 1 >= r.req.sampling.max_tokens
            if last or (r.sampler.greedy and not r.processors):
                tok = greedy[i]
                row = logits[i]
            else:
                row = r.process(logits[i], inputs[i : i + 1]) if r.processors else logits[i]
                tok = r.sampler.sample(row)
            toks.append(tok)
            lps.append(r.sampler.logprob_arrays(row, tok)
                       if r.sampler.wants_logprobs and not last else None)
        sampled = mx.stack(toks).astype(mx.uint32)
        mx.async_eval(sampled, *[a for lp in lps if lp is not None for a in lp])  # type: ignore[no-untyped-call]
        hook = rows[0].ctx.logits_hook is not None
        # host work for the tokens fed in this step (sampled in the previous one)
        fed = cast(list[int], inputs.tolist())
        if spec is not None:
            self._time_decode(spec, len(rows))
        prev_lps, prev_logits, prev_reported = self._lps, self._logits, self._reported
        finished: list[tuple[int, str]] = []
        for i, r in enumerate(rows):
            r.pos += 1
            if prev_reported[i]:
                continue
            lp = prev_lps[i]
            reason = r.accept(int(fed[i]), logprob_values(lp) if lp is not None else None,
                              prev_logits[i])
            if reason is not None:
                finished.append((i, reason))
        self._inputs = sampled
        self._reported = [False] * len(rows)
        self._lps = lps
        self._logits = [logits[i] for i in range(len(rows))] if hook else [None] * len(rows)
        self._after_step(finished, before)

    def _time_decode(self, spec: Speculator, rows: int) -> None:
        """The forward launched by the previous plain step is done when this one reads
        its tokens: the time since the previous read is one decode step (pipelined: the
        host work overlaps it) of that step's rows."""
        now = spec.clock()
        if self._synced is not None:
            spec.observe_decode(self._synced[1], now - self._synced[0])
        self._synced = (now, rows)

    def _speculative_step(self, spec: Speculator) -> bool:
        """Every row's pending token and its draft (``speculate.py``) in one forward of
        ``[rows, 1 + longest draft]`` (shorter drafts padded at the right). Synchronous
        (no pipelining). Per row, the longest draft prefix that decoding one token at a
        time would produce is kept plus the model's token after it; the caches are then
        repaired to hold exactly the positions each row keeps (``_repair``). A stop
        string or max_tokens inside an accepted draft ends the row there, its caches
        holding prompt + output[:-1], as without speculation. False: no verify is worth
        it, the caller decodes as usual (the pending tokens have been reported then)."""
        if self._inputs is None:  # step() checks it; a row without a pending token is a bug
            raise InvariantError("a speculative step over rows without pending tokens")
        pending = cast(list[int], self._inputs.tolist())
        # the pending tokens are reported before they are fed: a stop here saves the
        # state as it is (prompt + output[:-1])
        done: set[int] = set()
        for i, r in enumerate(self.rows):
            if self._reported[i]:
                continue
            self._reported[i] = True
            lp = self._lps[i]
            reason = r.accept(pending[i], logprob_values(lp) if lp is not None else None,
                              self._logits[i])
            if reason is not None:
                r.finish(reason, mlx_compat.row_caches(self.cache, i), state_pos=r.pos)
                done.add(i)
        if done:
            pending = [p for i, p in enumerate(pending) if i not in done]
            self._remove(done)
            if not self.rows:
                return True
        rows = self.rows
        drafts: list[Sequence[int]] = [spec.propose(r) for r in rows]
        cut = spec.plan(rows, drafts, self.cache, self.model)
        if cut == 0:
            return False
        # the verify's wall time, for the gate's online cost: the forward and reading its
        # tokens (the sync the step does anyway); not the drafting (a tenant pool's first
        # seeding reads the cache)
        t0 = spec.clock()
        drafts = [d[:cut] for d in drafts]
        width = 1 + max(len(d) for d in drafts)
        x = mx.array([[pending[i], *d, *([pending[i]] * (width - 1 - len(d)))]
                      for i, d in enumerate(drafts)], dtype=mx.uint32)
        states = mlx_compat.before_verify(self.cache)
        logits = self.model(x, cache=self.cache)
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
        spec.observe_verify(len(rows), width, spec.clock() - t0)
        self._synced = None  # the next plain step's read finds nothing in flight
        # array states that cannot take right-padded tokens (mlx_compat.states_take_lengths):
        # every row keeps as many positions as the shortest (greedy rows only: eligible)
        uniform = states is not None and len(rows) > 1 \
            and not mlx_compat.states_take_lengths(self.model)
        if uniform:
            cap = min(accepted)
            accepted = [min(a, cap) for a in accepted]
            bonus = [greedy[i][a] for i, a in enumerate(accepted)]
        for i, r in enumerate(rows):
            if drafts[i]:
                spec.feedback(r, len(drafts[i]), accepted[i])
        c = rows[0].ctx.counters
        c.decode_steps += 1
        c.decode_rows += len(rows)
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
        self._repair(x, states, held)
        bs = self.block_size
        for i, r in enumerate(rows):
            before = r.pos
            r.pos += kept[i]
            if i in stopped:
                exact = held[i] == kept[i]
                if not exact:
                    c.spec_unsaved += 1
                r.finish(stopped[i], mlx_compat.row_caches(self.cache, i) if exact else None,
                         state_pos=r.pos)
            elif r.sliding and r.pos // bs > before // bs:
                # a sliding window drops old tokens: store output blocks while in it
                r.store_decoded_block(mlx_compat.row_caches(self.cache, i))
        # the model's own token after each accepted draft: fed and reported next step
        self._inputs = mx.array(bonus, dtype=mx.uint32)
        self._reported = [False] * len(rows)
        self._lps = lps
        self._logits = [None] * len(rows)
        if stopped:
            self._remove(set(stopped))
        return True

    def _repair(self, x: mx.array, states: list[list[Any]] | None, kept: Sequence[int]
                ) -> None:
        """After a verify forward of ``x``: row ``i`` keeps its first ``kept[i]``
        positions. KV and sliding windows drop the rest (``mlx_compat.drop_row_tails``).
        Array states (SSM, linear attention) absorbed every position fed: unless every
        row keeps all of them, the states go back to before the verify
        (``states``), the KV leaves drop the whole verify, and the kept positions are
        fed again, right-padded (``lengths``: padding never reaches a state), so each
        state holds exactly its row's kept tokens."""
        width = int(x.shape[1])
        if states is None:
            mlx_compat.drop_row_tails(self.cache, [width - n for n in kept])
            return
        if all(n == width for n in kept):
            return
        mlx_compat.restore_before_verify(self.cache, states, width)
        mlx_compat.prepare_right_padded(self.cache, kept)
        self.model(x[:, :max(kept)], cache=self.cache)
        mlx_compat.finalize_right_padded(self.cache)
        self.rows[0].ctx.counters.spec_recomputes += 1

    def _after_step(self, finished: list[tuple[int, str]], before: list[list[Any]] | None
                    ) -> None:
        done = {i for i, _ in finished}
        for i, reason in finished:
            r = self.rows[i]
            # r.pos counts the token just fed; the save covers prompt + output[:-1]
            r.finish(reason, mlx_compat.row_caches(self.cache, i, before),
                     state_pos=r.pos - 1)
        bs = self.block_size
        for i, r in enumerate(self.rows):
            if i not in done and r.sliding and r.pos % bs == 0:
                # a sliding window drops old tokens: store output blocks while in it
                r.store_decoded_block(mlx_compat.row_caches(self.cache, i))
        if done:
            self._remove(done)


def decode_alone(req: Request) -> None:
    """One decode step of a request that cannot join the batch (its own caches)."""
    last = req.output[-1]
    fed = mx.array([last], dtype=mx.uint32)
    logits = req.ctx.model(fed[None], cache=req.caches)[0, -1]
    req.pos += 1
    if req.sliding and req.pos % req.ctx.block_size == 0:
        mx.eval(logits)
        req.store_decoded_block(req.caches)
    tok, lp = req.sample_now(logits, fed)
    reason = req.accept(tok, lp, logits)
    if reason is not None:
        req.finish(reason, req.caches)


def cancel_alone(reqs: Sequence[Request]) -> list[Request]:
    """Finish the cancelled ones of requests decoding alone; returns the others."""
    keep = []
    for r in reqs:
        if r.cancelled:
            r.finish("cancelled", r.caches)
        else:
            keep.append(r)
    return keep
