"""Batched decode: every decoding request advances in one forward per step, pipelined as in mlx-lm's
generate loop (step k launched, then step k-1's tokens reported, saved, finished rows removed).
``DecodeBatch`` holds the rows and mlx-lm's batch caches; rows leave for the cache as copies
(``mlx_compat.row_caches``), never views of the live batch. ``decode_alone`` is the per-request
path for caches mlx-lm cannot batch; speculation is ``plan_verify`` / forward / ``apply_verify``."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx

from .. import mlx_compat
from ..sampling import logprob_values
from ..speculation import apply_verify, plan_verify
from .request import Request

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
        # speculation's online cost: when the last plain step read its fed tokens (the
        # forward before it done), its rows and context; and the last step's timing
        self._synced: tuple[float, int, int] | None = None
        self._timed: tuple[int, float, int] | None = None
        # request id -> where a verify's repair moved its row's first positions
        self._moves: dict[str, mlx_compat.RowMoves] = {}

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def pending(self) -> mx.array | None:
        """Per row, the token it feeds next (None: no rows)."""
        return self._inputs

    @property
    def reported(self) -> list[bool]:
        """Per row, whether its pending token was reported already."""
        return self._reported

    def take_unreported(self, i: int) -> tuple[LogprobArrays | None, mx.array | None] | None:
        """Row ``i``'s pending token is reported now (by the caller): its logprobs and
        its logits (for the logits hook; None when not kept). None when it was reported
        already (the first token of a row that just joined)."""
        if self._reported[i]:
            return None
        self._reported[i] = True
        return self._lps[i], self._logits[i]

    def set_pending(self, tokens: mx.array, lps: list[LogprobArrays | None],
                    logits: list[mx.array | None] | None = None) -> None:
        """The tokens the rows feed next (sampled, not reported yet), their logprobs and
        their logits (None: not kept)."""
        n = len(self.rows)
        self._inputs = tokens
        self._reported = [False] * n
        self._lps = lps
        self._logits = logits if logits is not None else [None] * n

    def clear_decode_timing(self) -> None:
        """No plain forward is in flight (a verify step synced): the next plain step's
        read times nothing (``_time_decode``)."""
        self._synced = None

    def row_caches(self, i: int, before: list[list[Any]] | None = None) -> list[Any]:
        """Row ``i``'s caches for reading blocks (``mlx_compat.row_caches``)."""
        return mlx_compat.row_caches(self.cache, i, before,
                                     self._moves.get(self.rows[i].request_id))

    def moves(self) -> list[mlx_compat.RowMoves]:
        """Per row, where its positions were moved (``mlx_compat.drop_row_tails``)."""
        return [self._moves.setdefault(r.request_id, mlx_compat.RowMoves())
                for r in self.rows]

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

    def remove(self, drop: set[int]) -> None:
        """Take rows ``drop`` (indexes) out of the batch and its caches."""
        for i in drop:
            self._moves.pop(self.rows[i].request_id, None)
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
            r.finish("cancelled", self.row_caches(i), state_pos=pos)
        self.remove(gone)

    def fail_all(self, error: str) -> None:
        for r in self.rows:
            r.fail(error)
        self.remove(set(range(len(self.rows))))

    # ------------------------------------------------------------------ the step

    def step(self) -> None:
        """One batched forward (launched asynchronously), then the host work of the
        previous step's tokens; or, when the speculator plans one, a verify forward of
        every row's draft."""
        if not self.rows or self._inputs is None:
            return
        spec = self.rows[0].ctx.speculator
        if spec is not None:
            plan = plan_verify(spec, self)
            if plan is not None:
                apply_verify(spec, self, plan, self.model(plan.x, cache=self.cache))
                return
            if not self.rows:  # every row stopped at its reported token
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
            self._time_decode()
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
        self.set_pending(sampled, lps, [logits[i] for i in range(len(rows))] if hook else None)
        self._after_step(finished, before)

    def context(self) -> int:
        """The tokens a forward of the batch attends to: its longest row's in the caches
        (speculation's online cost compares steps over as many)."""
        return max(r.pos for r in self.rows)

    def _time_decode(self) -> None:
        """The forward launched by the previous plain step is done when this one reads
        its tokens: the time since the previous read is one decode step (pipelined: the
        host work overlaps it) of that step's rows, over its ``context``."""
        now = time.perf_counter()
        if self._synced is not None:
            at, n, context = self._synced
            self._timed = (n, now - at, context)
        self._synced = (now, len(self.rows), self.context())

    def take_decode_timing(self) -> tuple[int, float, int] | None:
        """The last plain step's (rows, seconds, context), once."""
        timed, self._timed = self._timed, None
        return timed

    def _after_step(self, finished: list[tuple[int, str]], before: list[list[Any]] | None
                    ) -> None:
        done = {i for i, _ in finished}
        for i, reason in finished:
            r = self.rows[i]
            # r.pos counts the token just fed; the save covers prompt + output[:-1]
            r.finish(reason, self.row_caches(i, before),
                     state_pos=r.pos - 1)
        bs = self.block_size
        for i, r in enumerate(self.rows):
            if i not in done and r.sliding and r.pos % bs == 0:
                # a sliding window drops old tokens: store output blocks while in it
                r.store_decoded_block(self.row_caches(i))
        if done:
            self.remove(done)


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
