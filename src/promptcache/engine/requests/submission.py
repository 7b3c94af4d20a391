"""The Engine's request intake: validate, admit or queue, cancel, start on the engine thread."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable

import numpy as np
from mlx_lm.sample_utils import make_logits_processors

from ...errors import EngineDeadError
from ..api import GenerationRequest, GenerationResult, Usage
from ..context import EngineContext, Processor, validate_request
from ..formats import constrained
from .admission import Admission, Ticket
from .arrivals import Arrivals
from .handles import RequestHandle
from .request import Request

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _Pending:
    """What a ticket carries until the engine thread starts the request."""

    request: GenerationRequest
    tokens: np.ndarray
    handle: RequestHandle
    processors: list[Processor]
    t_submit: float


class Submission:
    """``submit`` (any thread) and the tickets' life until the engine thread starts the
    request (``make_request``, the scheduler's) or answers it unstarted
    (``fail_pending``). ``failure`` is the engine thread's death (None while it lives),
    ``closed`` whether the engine was closed."""

    def __init__(self, ctx: EngineContext, admission: Admission, control: Arrivals, *,
                 failure: Callable[[], str | None], closed: Callable[[], bool],
                 memory_check: Callable[[int, int], int] | None = None) -> None:
        self._ctx = ctx
        self._admission = admission
        self._control = control
        self._failure = failure
        self._closed = closed
        # (prompt tokens, prompt + max_tokens) -> raises when its memory peak cannot fit
        self.memory_check = memory_check
        self._ids = itertools.count(1)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Validate and admit (or queue); returns at once. Raises ``RequestError`` (a
        ValueError), ``OverloadedError`` or ``EngineDeadError``."""
        dead = self._failure()
        if dead is not None:
            raise EngineDeadError(f"the engine thread died: {dead}")
        if self._closed():
            raise RuntimeError("the engine is closed")
        ctx = self._ctx
        tokens = validate_request(request, ctx)
        processors: list[Processor] = []
        if request.constraint is not None:
            processors.append(constrained.logits_processor(
                request.constraint, ctx.tokenizer, ctx.vocab_size))
        sp = request.sampling
        if sp.logit_bias or sp.penalized:
            # after the grammar: a bias never revives a token the grammar masked out;
            # pure functions of the tokens, so a verify checks drafts through them
            bias = make_logits_processors(logit_bias=dict(sp.logit_bias) or None)
            penalties = make_logits_processors(
                repetition_penalty=sp.repetition_penalty if sp.repetition_penalty != 1.0 else None,
                repetition_context_size=sp.penalty_context,
                presence_penalty=sp.presence_penalty or None,
                presence_context_size=sp.penalty_context,
                frequency_penalty=sp.frequency_penalty or None,
                frequency_context_size=sp.penalty_context)
            processors.extend(constrained.TokenProcessor(fn) for fn in bias)
            processors.extend(constrained.TokenProcessor(constrained.sparing(fn, ctx.eos_token_ids))
                              for fn in penalties)
        if not request.request_id:
            request = dataclasses.replace(request, request_id=f"req-{next(self._ids)}")
        handle = RequestHandle(request, on_cancel=self._on_cancel)
        pending = _Pending(request, tokens, handle, processors, time.perf_counter())
        length = int(tokens.shape[0]) + (0 if request.prefill_only else request.sampling.max_tokens)
        peak = 0
        if self.memory_check is not None:
            peak = self.memory_check(int(tokens.shape[0]), length)
        ticket = Ticket(pending, length, background=request.priority == "background",
                        peak=peak)
        handle.ticket = ticket
        self._admission.submit(ticket)
        dead = self._failure()
        if dead is not None:  # died while we were admitting: nobody will take it
            self.fail_pending(f"the engine thread died: {dead}")
        self._control.wake.set()
        return handle

    def announce(self) -> Callable[[], None]:
        """The caller is preparing a request it will ``submit`` (the server announces
        every generation request before rendering its prompt): an idle engine gathering
        a burst waits for it (``arrivals.py``). Returns the release (idempotent), to
        call when the preparation ends, submitted or not. Thread-safe."""
        return self._control.announce()

    def _on_cancel(self, handle: RequestHandle) -> None:
        ticket = handle.ticket
        if ticket is not None and self._admission.cancel(ticket):
            self._ctx.counters.cancelled += 1
            handle.emit(_empty_result(handle.request, "cancelled", queue_s=0.0))
        self._control.wake.set()

    def make_request(self, ticket: Ticket) -> Request | None:
        """The request of an admitted ticket, started (engine thread); None when it was
        cancelled while it waited or could not start (answered here)."""
        p: _Pending = ticket.item
        if p.handle.cancel_requested:
            p.handle.emit(_empty_result(p.request, "cancelled", ticket.queue_s))
            self._ctx.counters.cancelled += 1
            return None
        try:
            return Request(self._ctx, p.request, p.tokens, p.handle.emit,
                           cancelled=lambda: p.handle.cancel_requested,
                           processors=p.processors, queue_s=ticket.queue_s,
                           t_submit=p.t_submit)
        except Exception as e:  # one request that cannot start fails alone
            logger.exception("request %s could not start", p.request.request_id)
            self._ctx.counters.errors += 1
            p.handle.emit(_empty_result(p.request, "error", ticket.queue_s,
                                         f"{type(e).__name__}: {e}"))
            return None

    def fail_pending(self, error: str | None) -> None:
        """Answer every ticket that was never started (error, or cancelled on close)."""
        for t in self._admission.drain():
            p: _Pending = t.item
            reason = "error" if error is not None else "cancelled"
            p.handle.emit(_empty_result(p.request, reason, t.queue_s, error))


def preempt(ticket: Ticket) -> None:
    """``Admission``'s ``on_preempt``: a background request gives its slot back to a
    waiting interactive one: it is cancelled (its saved blocks stay); the slot frees
    when the scheduler drops it."""
    p: _Pending = ticket.item
    logger.debug("background request %s preempted by a waiting interactive request",
                 p.request.request_id)
    p.handle.cancel()


def _empty_result(req: GenerationRequest, reason: str, queue_s: float,
                  error: str | None = None) -> GenerationResult:
    return GenerationResult(tokens=[], text="", finish_reason=reason,
                            usage=Usage(prompt_tokens=len(req.prompt_tokens)), error=error,
                            queue_s=queue_s)
