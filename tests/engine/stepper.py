"""Drive a Scheduler step by step on the test thread (deterministic: no engine thread,
no timing). Uses an engine's model, tokenizer and cache while that engine is idle."""

from __future__ import annotations

from dataclasses import dataclass, field

from promptcache.engine.api import GenerationRequest, GenerationResult, SamplingParams, TokenEvent
from promptcache.engine.requests.admission import Admission, Ticket
from promptcache.engine.requests.request import EngineContext, Request, validate_request
from promptcache.engine.requests.scheduler import Scheduler
from promptcache.serving_config import EngineConfig


@dataclass(eq=False)
class Run:
    """One request driven by a Stepper: its events as they were emitted."""

    request: GenerationRequest
    events: list = field(default_factory=list)
    cancelled: bool = False
    req: Request | None = None

    @property
    def result(self) -> GenerationResult | None:
        last = self.events[-1] if self.events else None
        return last if isinstance(last, GenerationResult) else None

    @property
    def tokens(self) -> list[int]:
        return [e.token_id for e in self.events if isinstance(e, TokenEvent)]

    def cancel(self) -> None:
        self.cancelled = True


class Stepper:
    def __init__(self, engine, **config) -> None:
        base = engine._ctx
        cfg = EngineConfig(**{**engine.engine_config.__dict__, **config})
        self.ctx = EngineContext(
            model=base.model, tokenizer=base.tokenizer, config=cfg,
            context_length=base.context_length, vocab_size=base.vocab_size,
            eos_token_ids=base.eos_token_ids, cache=base.cache,
            namespace_for=base.namespace_for, block_size=base.block_size,
            logits_hook=base.logits_hook, kv_quant=base.kv_quant)
        # a preempted background request is cancelled, as the engine does
        self.admission = Admission(cfg.max_active_requests, cfg.max_queued_requests,
                                   cfg.active_kv_budget_bytes, engine.row_bytes,
                                   on_preempt=lambda t: t.item.cancel())
        self.scheduler = Scheduler(self.ctx, self.admission, self._make)
        self._ids = 0

    def _make(self, ticket: Ticket) -> Request:
        run: Run = ticket.item
        tokens = validate_request(run.request, self.ctx)
        req = Request(self.ctx, run.request, tokens, run.events.append,
                      cancelled=lambda: run.cancelled, queue_s=ticket.queue_s)
        run.req = req
        return req

    def submit(self, tokens, max_tokens: int = 6, *, background: bool = False,
               prefill_only: bool = False, use_cache: bool = True, tenant: str = "default",
               **sampling) -> Run:
        self._ids += 1
        req = GenerationRequest(
            prompt_tokens=tuple(tokens), sampling=SamplingParams(max_tokens=max_tokens, **sampling),
            use_cache=use_cache, request_id=f"step-{self._ids}", tenant=tenant,
            priority="background" if background else "interactive", prefill_only=prefill_only)
        run = Run(req)
        length = len(tokens) + (0 if prefill_only else max_tokens)
        self.admission.submit(Ticket(run, length, background=background))
        return run

    def step(self) -> bool:
        return self.scheduler.step()

    def run(self, limit: int = 10_000) -> int:
        """Step until idle; returns the number of steps."""
        n = 0
        while self.step():
            n += 1
            if n > limit:
                raise AssertionError("the scheduler did not become idle")
        return n
