"""The scheduler: one step = one batched decode forward + prefill chunks (``step`` gives the order).
Interactive requests whose caches batch exactly prefill together (``prefill.py``, one chunk per
row per step); the rest (a lone request, quantized KV, windows that keep tokens, images,
background work) prefill one chunk per step, background only when nothing interactive is. A step
thus delays running streams by at most one chunk per prefilling request."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ...blocks.tokens import common_prefix
from .. import mlx_compat
from ..context import EngineContext
from ..payload import adapters
from .admission import Admission, Ticket
from .batch import DecodeBatch, cancel_alone, decode_alone
from .prefill import PrefillBatch, Prefilled, attention_heads, workspace_bytes
from .request import Request

logger = logging.getLogger(__name__)


# builds the Request of an admitted ticket (None: it could not start and was answered)
MakeRequest = Callable[[Ticket], Request | None]


class Scheduler:
    """Owns every admitted request; driven by the engine thread (or a test)."""

    def __init__(self, ctx: EngineContext, admission: Admission, make_request: MakeRequest
                 ) -> None:
        self.ctx = ctx
        self.admission = admission
        self.make_request = make_request
        self.prefilling: list[Request] = []  # admission order, not in the prefill batch
        self.group = PrefillBatch(ctx.model)  # prefilling together
        self._heads = attention_heads(ctx.model)
        self._solo: set[Request] = set()  # interactive, on the per-request prefill path
        self.ready: list[Request] = []  # prefill done, waiting for a batch row
        self.alone: list[Request] = []  # decoding outside the batch
        self.batch = DecodeBatch(ctx.model, ctx.block_size)
        self._live: list[tuple[Request, Ticket]] = []
        self.steps = 0
        self.last_prefilled: Request | None = None  # which request got this step's chunk

    # ------------------------------------------------------------------ state

    @property
    def idle(self) -> bool:
        return not (self.prefilling or len(self.group) or self.ready or self.alone
                    or len(self.batch) or self.admission.has_ready)

    @property
    def interactive_busy(self) -> bool:
        """An interactive request was started (prefilling, waiting for a row, decoding):
        background work alone (next-turn pre-renders) does not count."""
        return any(not r.background for r in self.requests())

    def requests(self) -> list[Request]:
        return [*self.prefilling, *self.group.rows, *self.ready, *self.alone,
                *self.batch.rows]

    def active_kv_bytes(self) -> int:
        total = self.batch.nbytes() + self.group.nbytes()
        for r in (*self.prefilling, *self.ready, *self.alone):
            total += sum(int(a.nbytes) for _, a in adapters.state_arrays(r.caches))
        return total

    # ------------------------------------------------------------------ the step

    def step(self) -> bool:
        """One scheduler step; False if there was nothing to do."""
        self._take_admitted()
        if self.idle:
            return False
        self.steps += 1
        self._drop_cancelled()
        # a dropped request freed its slot: who was admitted to it starts this step
        # (a preempted background request gives way within one prefill chunk)
        self._take_admitted()
        if len(self.batch):
            self._guard(self.batch.rows, self.batch.step, on_error=self.batch.fail_all)
            c = self.ctx.counters
            c.decode_steps += 1
            c.decode_rows += len(self.batch.rows)
            c.max_batch = max(c.max_batch, len(self.batch.rows))
        self.last_prefilled = None
        self._fill_group()
        if len(self.group):
            self._guard(self.group.rows, self._group_step, on_error=self.group.fail_all)
        req = self._next_alone()
        if req is not None:
            self.last_prefilled = req
            self._guard([req], lambda: self._prefill(req), on_error=req.fail)
        for r in list(self.alone):
            self.ctx.counters.solo_steps += 1
            self._guard([r], lambda r=r: decode_alone(r), on_error=r.fail)  # type: ignore[misc]
        self._place_ready()
        self._release_finished()
        c = self.ctx.counters
        c.active_kv_bytes = self.active_kv_bytes()
        c.peak_active_kv_bytes = max(c.peak_active_kv_bytes, c.active_kv_bytes)
        return True

    def _guard(self, reqs: list[Request], fn: Callable[[], Any],
               on_error: Callable[[str], None]) -> None:
        """Run model work; a failure ends the requests it concerns, not the engine."""
        try:
            fn()
        except Exception as e:
            logger.exception("model step failed for %d request(s)", len(reqs))
            on_error(f"{type(e).__name__}: {e}")

    def _take_admitted(self) -> None:
        for t in self.admission.take():
            req = self.make_request(t)
            if req is None:
                self.admission.release(t)
                continue
            # the slot is freed before the result reaches the client (and again, as a
            # no-op, by _release_finished)
            req.on_finish = lambda t=t: self.admission.release(t)
            self._live.append((req, t))
            self.prefilling.append(req)

    def _drop_cancelled(self) -> None:
        for r in [r for r in self.prefilling if r.cancelled]:
            r.finish("cancelled", r.caches if r.phase == "decode" else None)
        self.prefilling = [r for r in self.prefilling if not r.done]
        self._solo = {r for r in self._solo if not r.done}
        self.group.drop_cancelled()
        self.ready = cancel_alone(self.ready)
        self.alone = cancel_alone(self.alone)
        self.batch.drop_cancelled()

    def _fill_group(self) -> None:
        """Move waiting interactive requests into the prefill batch, oldest first,
        while it has rows and tokens left for this step."""
        cfg = self.ctx.config
        pending = [r for r in self.prefilling if not r.background and r not in self._solo]
        pending = self._not_waiting_for_a_prefix(pending)
        if not pending:
            return
        solo_busy = any(not r.background for r in self._solo)
        if not len(self.group) and len(pending) == 1 and not solo_busy:
            self._solo.add(pending[0])  # alone: its own caches, no copy into a batch
            return
        budget = cfg.prefill_batch_tokens - self.group.step_tokens()
        joining: list[Request] = []
        for r in pending:
            if len(self.group) + len(joining) >= cfg.prefill_batch_size:
                break
            if r.phase == "new":
                self._guard([r], r.start, on_error=r.fail)
                if r.done:
                    continue
            if (r.images is not None or r.splice is not None
                    or not mlx_compat.can_batch_prefill(r.caches, self.ctx.model)
                    or not mlx_compat.can_batch(r.caches)):
                self._solo.add(r)
                continue
            n = r.chunk_end() - r.pos
            if (len(self.group) or joining) and n > budget:
                break
            if (len(self.group) or joining) and not self._workspace_fits([*joining, r]):
                self.ctx.counters.prefill_workspace_waits += 1
                break
            budget -= n
            joining.append(r)
        self.prefilling = [r for r in self.prefilling if not r.done and r not in joining]
        if joining:
            def fail(error: str) -> None:
                for r in joining:
                    r.fail(error)
                self.group.fail_all(error)
            self._guard(joining, lambda: self.group.join(joining), on_error=fail)

    def _workspace_fits(self, joining: list[Request]) -> bool:
        """Whether the prefill batch with ``joining`` added keeps its attention workspace
        within what the admitted requests' KV reservations leave of the KV budget, up
        to the end of every row's prompt (the context only grows): reserved KV +
        workspace <= ``--kv-budget``. A lone row always prefills (on its own path)."""
        room = self.admission.room()
        if room is None:
            return True
        rows = [*self.group.rows, *joining]
        # a chunk is at most 1.5 x the chunk size (Request.chunk_end)
        chunk = max(self.ctx.config.prefill_chunk_tokens,
                    *(r.chunk_end() - r.pos for r in rows))
        need = workspace_bytes(len(rows), chunk, max(r.n_prompt for r in rows), self._heads)
        return need <= room

    def _not_waiting_for_a_prefix(self, pending: list[Request]) -> list[Request]:
        """The pending requests that start now. One that shares at least
        ``share_prefix_min_tokens`` whole blocks (neither computed nor cached) with an
        interactive request being prefilled waits until that leader has stored them, then
        restores them: requests sent together with one system prompt + tools compute it once."""
        need = self.ctx.config.share_prefix_min_tokens
        if need <= 0 or self.ctx.cache is None or not pending:
            return pending
        leaders = [r for r in (*self.group.rows, *self._solo)
                   if not r.done and not r.background and not r.prefill_done]
        starting: list[Request] = []
        for r in pending:
            if r.phase == "new" and self._waits_for_prefix(r, leaders, need):
                if not r.waited_for_prefix:
                    r.waited_for_prefix = True
                    self.ctx.counters.shared_prefix_waits += 1
                continue
            starting.append(r)
            leaders.append(r)
        return starting

    def _waits_for_prefix(self, r: Request, leaders: list[Request], need: int) -> bool:
        """Whether ``r`` waits for a leader: they share >= ``need`` whole-block tokens
        that neither the leader has computed yet nor the cache holds for ``r`` already
        (its own earlier turn, say: a pure lookup, made only when a leader qualifies)."""
        if not r.use_cache or r.images is not None or r.extra_keys:
            return False
        bs = self.ctx.block_size
        mine = r.sequence(r.n_prompt)
        own: int | None = None
        for lead in leaders:
            if (lead.ns != r.ns or not lead.use_cache or lead.images is not None
                    or lead.extra_keys):
                continue
            shared = common_prefix(mine, lead.sequence(lead.n_prompt)) // bs * bs
            if shared - lead.pos < need:
                continue
            if own is None:
                own = self._cached_tokens(r)
            if shared - max(lead.pos, own) >= need:
                return True
        return False

    def _cached_tokens(self, r: Request) -> int:
        """How much of ``r``'s prompt the cache could restore now (a failing lookup
        counts as all of it: never wait on a broken cache)."""
        cache = self.ctx.cache
        if cache is None or r.ns is None:
            return r.n_prompt
        try:
            return int(cache.lookup(r.sequence(r.n_prompt), r.ns).num_tokens)
        except Exception:
            logger.debug("lookup for the shared-prefix wait failed", exc_info=True)
            return r.n_prompt

    def _group_step(self) -> None:
        done = self.group.step()
        if done is not None:
            def fail(error: str) -> None:
                for r in done.reqs:
                    r.fail(error)
            self._guard(done.reqs, lambda: self._place_prefilled(done), on_error=fail)

    def _place_prefilled(self, done: Prefilled) -> None:
        """Rows whose prompt ended in the prefill batch: into the decode batch at once
        (their batch cache is extended into it) or, with no room, to wait with copies."""
        if not self.ready and len(self.batch) + len(done.reqs) <= self.ctx.config.max_batch_size:
            self.batch.join_batch(done.reqs, [r.output[-1] for r in done.reqs], done.cache)
            return
        for i, r in enumerate(done.reqs):
            r.caches = mlx_compat.copy_row(done.cache, i)
            self.ready.append(r)

    def _next_alone(self) -> Request | None:
        """The request that gets this step's per-request prefill chunk."""
        solo = [r for r in self.prefilling if r.background or r in self._solo]
        for r in solo:
            if not r.background:
                return r
        if len(self.group) or any(not r.background for r in self.prefilling):
            return None  # an interactive request is prefilling
        return solo[0] if solo else None

    def _prefill(self, req: Request) -> None:
        if req.phase == "new":
            req.start()
        if req.prefill_chunk():
            self.prefilling.remove(req)
            self._solo.discard(req)
            if not req.done:
                self.ready.append(req)

    def _place_ready(self) -> None:
        limit = self.ctx.config.max_batch_size
        waiting: list[Request] = []
        for r in self.ready:
            if r.done:
                continue
            if not mlx_compat.can_batch(r.caches):
                self.alone.append(r)
            elif len(self.batch) < limit:
                self._guard([r], lambda r=r: self.batch.join(r, r.output[-1]),  # type: ignore[misc]
                            on_error=r.fail)
            else:
                waiting.append(r)
        self.ready = waiting
        self.alone = [r for r in self.alone if not r.done]

    def _release_finished(self) -> None:
        live = []
        for req, t in self._live:
            if req.done:
                self.admission.release(t)
            else:
                live.append((req, t))
        self._live = live

    # ------------------------------------------------------------------ shutdown

    def fail_all(self, error: str, reason: str = "error") -> None:
        """End every request (engine shutdown or death)."""
        for r in self.requests():
            if not r.done:
                if reason == "cancelled":
                    r.finish("cancelled", None)
                else:
                    r.fail(error)
        self.prefilling, self.ready, self.alone = [], [], []
        self._solo = set()
        self.group = PrefillBatch(self.ctx.model)
        self.batch = DecodeBatch(self.ctx.model, self.ctx.block_size)
        for _, t in self._live:
            self.admission.release(t)
        self._live = []
