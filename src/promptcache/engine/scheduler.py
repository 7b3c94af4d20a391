"""The scheduler: one step = one batched decode forward + at most one prefill chunk.

Why our own scheduler over mlx-lm's batch caches rather than mlx-lm's
``BatchGenerator`` (measured, see BENCHMARKS.md "Batched decode"): both decode
through the same batch caches, so a decode step costs the same; but
``BatchGenerator`` reaches a running request's state only through
``extract_cache`` -- a copy of the request's whole KV -- which makes the mid-prefill
save point quadratic in the prompt length, it prefills a batch of prompts together
(a burst of arrivals delays every stream by several chunks), and it has no notion
of priority. Here a request prefills alone in its own mlx-lm caches (the save
points read blocks straight out of them, as for a single request), then joins the
batch with them.

Each ``step()``:
1. takes newly admitted requests (``Admission.take``) into the prefill queue;
2. finishes cancelled requests wherever they are (and takes who was admitted to
   the slots they freed, e.g. an interactive request that preempted a background one);
3. launches the batched decode forward (``DecodeBatch.step``: pipelined, the host
   work of the previous step's tokens overlaps it);
4. runs ONE prefill chunk: of the oldest interactive request; a background request
   (next-turn pre-render, shadow verification) only when no interactive request is
   prefilling, so a new interactive request waits at most the background chunk in
   flight. A request's first chunk also does its cache lookup and restore;
5. advances the requests mlx-lm cannot batch (one forward each);
6. moves requests whose prefill ended into the batch (up to ``max_batch_size``
   rows; more wait for a free row) or, if their caches cannot batch, to the
   per-request path.
A request releases its admission ticket when it finishes, before its result is
delivered (so a client that has its answer is no longer counted as active).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from . import adapters, mlx_compat
from .admission import Admission, Ticket
from .batch import DecodeBatch, cancel_alone, decode_alone
from .request import EngineContext, Request

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
        self.prefilling: list[Request] = []  # admission order
        self.ready: list[Request] = []  # prefill done, waiting for a batch row
        self.alone: list[Request] = []  # decoding outside the batch
        self.batch = DecodeBatch(ctx.model, ctx.block_size)
        self._live: list[tuple[Request, Ticket]] = []
        self.steps = 0
        self.last_prefilled: Request | None = None  # which request got this step's chunk

    # ------------------------------------------------------------------ state

    @property
    def idle(self) -> bool:
        return not (self.prefilling or self.ready or self.alone or len(self.batch)
                    or self.admission.has_ready)

    def requests(self) -> list[Request]:
        return [*self.prefilling, *self.ready, *self.alone, *self.batch.rows]

    def active_kv_bytes(self) -> int:
        total = self.batch.nbytes()
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
        req = self._next_prefill()
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
        self.ready = cancel_alone(self.ready)
        self.alone = cancel_alone(self.alone)
        self.batch.drop_cancelled()

    def _next_prefill(self) -> Request | None:
        for r in self.prefilling:
            if not r.background:
                return r
        return self.prefilling[0] if self.prefilling else None

    def _prefill(self, req: Request) -> None:
        if req.phase == "new":
            req.start()
        if req.prefill_chunk():
            self.prefilling.remove(req)
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
        self.batch = DecodeBatch(self.ctx.model, self.ctx.block_size)
        for _, t in self._live:
            self.admission.release(t)
        self._live = []
