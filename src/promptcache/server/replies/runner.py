"""The shared request path of every API: checks, submit, event pump, accounting.
``ServerState`` holds what the routers need; ``ServerState.start(...)`` submits a request
and returns a ``Generation`` whose ``events()`` yield the engine's events, cancelling the
request when the client goes away (the blocks stored so far stay). Each finished request
is published once as ``RequestFinished`` (``finished.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from ...advisor import EvictionAdvisor
from ...autotune import AutoTuner
from ...engine.api import (
    Constraint,
    GenerationRequest,
    GenerationResult,
    ImageInput,
    SamplingParams,
    TokenEvent,
)
from ...engine.port import EngineAPI, HandleAPI
from ...errors import OverloadedError
from ...serving_config import EngineConfig, ServerConfig
from ...sessions import SessionReaper
from ..api.auth import Authenticator, Scope
from ..api.errors import APIError
from ..finished import RequestFinished, Subscriber, log_line, publish
from ..ops.alerts import HitRateMonitor
from ..ops.history import RequestHistory
from ..ops.metrics import ServerMetrics
from ..ops.outcome import MISS, Outcome, outcome_of
from ..ops.session_stats import SessionStats
from ..prompts.images import ImageCollector

if TYPE_CHECKING:
    from ..prompts.prerender import PreRenderer

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.2
BASE_ALIASES = ("default", "promptcache")


@dataclass(frozen=True)
class Penalties:
    """A request's own penalties (None: the server's default; OpenAI's presence and
    frequency penalties, mlx_lm.server's and vLLM's ``repetition_penalty`` and
    ``repetition_context_size``)."""

    repetition: float | None = None
    presence: float | None = None
    frequency: float | None = None
    context: int | None = None


@dataclass
class ServerState:
    engine: EngineAPI
    config: ServerConfig
    engine_config: EngineConfig
    auth: Authenticator
    monitor: HitRateMonitor
    metrics: ServerMetrics
    aliases: frozenset[str] = frozenset()
    started_at: float = field(default_factory=time.time)
    # per-session and per-agent request counts for /v1/cache/stats (server/ops/session_stats.py)
    session_stats: SessionStats = field(default_factory=SessionStats)
    # the recent finished requests the dashboard draws (server/ops/history.py)
    history: RequestHistory = field(default_factory=RequestHistory)
    # extra dashboard panels: tenant scope (None: every tenant) -> {name: data}
    panels: list[Callable[[str | None], dict[str, Any]]] = field(default_factory=list)
    # --session-ttl: deletes idle sessions (sessions.py); touched by every request
    sessions: SessionReaper | None = None
    # the automated diagnosis (advisor.py) and --auto-tune (autotune.py), when the
    # engine has a cache
    advisor: EvictionAdvisor | None = None
    tuner: AutoTuner | None = None
    # the next-turn pre-renderer (prerender.py; also app.state.pc_prerender): its
    # snapshot() is the ``prerender`` line of /v1/cache/stats
    prerender: PreRenderer | None = None
    # who hears of every finished request (finished.py); the standard subscribers first
    finished: list[Subscriber] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.finished[:0] = standard_subscribers(self)

    @property
    def model_id(self) -> str:
        return str(self.engine.model_id)

    def image_collector(self) -> ImageCollector | None:
        """A new request's image collector when the model takes images, else None
        (a text-only model: image parts stay a 400)."""
        info = self.engine.vision
        return ImageCollector(info, self.config.images) if info is not None else None

    def check_model(self, name: str | None) -> str:
        """The served model id for an accepted name; 404 model_not_found otherwise."""
        if name is None or name == "" or name == self.model_id or name in self.aliases:
            return self.model_id
        raise APIError(404, f"model {name!r} is not served here; use {self.model_id!r} "
                            f"(or one of: {', '.join(sorted(self.aliases))})",
                       code="model_not_found", param="model")

    def sampling(self, *, max_tokens: int, temperature: float | None, top_p: float | None,
                 seed: int | None, stop: Sequence[str] | str | None, top_k: int | None = None,
                 logprobs: int | None = None,
                 logit_bias: tuple[tuple[int, float], ...] = (),
                 penalties: Penalties | None = None) -> SamplingParams:
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        pen = penalties or Penalties()
        if len(stops) > 16:
            raise APIError(400, "at most 16 stop sequences are supported", param="stop")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if temperature is None else float(temperature),
            top_p=1.0 if top_p is None else float(top_p),
            seed=seed,
            stop=stops,
            top_k=top_k or 0,
            logprobs=logprobs,
            logit_bias=logit_bias,
            repetition_penalty=(self.engine_config.repetition_penalty
                                if pen.repetition is None else float(pen.repetition)),
            presence_penalty=float(pen.presence or 0.0),
            frequency_penalty=float(pen.frequency or 0.0),
            penalty_context=(self.engine_config.repetition_context_size
                             if pen.context is None else pen.context),
        )

    def start(self, api: str, http_request: Request, scope: Scope, prompt: Sequence[int],
              sampling: SamplingParams, message_starts: Sequence[int] = (),
              images: Sequence[ImageInput] = (),
              constraint: Constraint | None = None) -> Generation:
        req = GenerationRequest(
            # a C-speed copy; the engine validates the ids (its fast path) in submit
            prompt_tokens=tuple(prompt),
            sampling=sampling,
            tenant=scope.tenant,
            session_id=scope.session_id,
            agent_id=scope.agent_id,
            message_starts=tuple(message_starts),
            request_id=uuid.uuid4().hex[:16],
            images=tuple(images),
            constraint=constraint,
        )
        try:
            # ValueError -> 400, OverloadedError -> 429 / 529 + Retry-After,
            # EngineDeadError -> 503 (the app's exception handlers)
            handle = self.engine.submit(req)
        except OverloadedError:
            self.metrics.observe_failure(api, "overloaded")
            raise
        if self.sessions is not None:
            self.sessions.touch(scope.tenant, scope.session_id)
        return Generation(self, api, http_request, req, handle, scope)


class Generation:
    """One submitted request; iterate ``events()`` exactly once."""

    def __init__(self, state: ServerState, api: str, http_request: Request,
                 req: GenerationRequest, handle: HandleAPI, scope: Scope | None = None) -> None:
        self.state = state
        self.api = api
        self.scope = scope or Scope(tenant=req.tenant, session_id=req.session_id)
        self.http_request = http_request
        self.request = req
        self.handle = handle
        self.t0 = time.monotonic()
        self.first_token_s: float | None = None
        self.result: GenerationResult | None = None
        self.disconnected = False
        # called once with the final result (turns.start: remember the turn); returns
        # what the cache did and the miss note of the log line (None: ``plain_outcome``)
        self.on_result: Callable[[GenerationResult], tuple[Outcome, str | None]] | None = None
        state.metrics.in_flight.inc()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await self.http_request.is_disconnected():
                self.disconnected = True
                log.info("request %s: client disconnected, cancelling", self.request.request_id)
                self.handle.cancel()
                return

    async def events(self) -> AsyncIterator[TokenEvent | GenerationResult]:
        watcher = asyncio.create_task(self._watch())
        try:
            async for ev in self.handle.aevents():
                if isinstance(ev, GenerationResult):
                    self.result = ev
                    self._finish(ev)
                    yield ev
                    return
                if self.first_token_s is None:
                    self.first_token_s = time.monotonic() - self.t0
                yield ev
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher
            if self.result is None:
                self.handle.cancel()
                self.state.metrics.observe_failure(self.api, "cancelled")
                self.state.metrics.in_flight.dec()
                log.info("request %s api=%s tenant=%s cancelled (client gone) after %.2fs",
                         self.request.request_id, self.api, self.request.tenant,
                         time.monotonic() - self.t0)

    async def collect(self) -> tuple[str, GenerationResult]:
        """Run to the end (non-streaming); returns (text, result)."""
        parts: list[str] = []
        result: GenerationResult | None = None
        async for ev in self.events():
            if isinstance(ev, GenerationResult):
                result = ev
            else:
                parts.append(ev.text)
        if result is None:  # pragma: no cover - the engine always ends with a result
            raise RuntimeError("engine stream ended without a result")
        joined = "".join(parts)
        return (result.text if result.text or not joined else joined), result

    def _finish(self, result: GenerationResult) -> None:
        """The final result: publish it (``RequestFinished``) to the app's subscribers."""
        self.state.metrics.in_flight.dec()
        outcome, note = plain_outcome(result, self.state.engine.cache is not None)
        if result.finish_reason != "error" and self.on_result is not None:
            try:
                outcome, note = self.on_result(result)
            except Exception:  # a hook must never break the response
                log.warning("request %s: result hook failed", self.request.request_id,
                            exc_info=True)
        publish(self.state.finished, RequestFinished(
            api=self.api, request_id=self.request.request_id, tenant=self.request.tenant,
            scope=self.scope, result=result,
            ttft_s=result.ttft_s if result.ttft_s > 0 else self.first_token_s, note=note,
            outcome=outcome))


def plain_outcome(result: GenerationResult, caching: bool) -> tuple[Outcome, str | None]:
    """What the cache did for a request with no previous turn to compare with (a raw
    completions prompt), and its miss note (the engine's ``miss_reason`` of a miss)."""
    u = result.usage
    outcome = outcome_of(u.prompt_tokens, u.cached_tokens + u.recomputed_tokens, result.miss,
                         cached_by_tier=u.served_by_tier, caching=caching)
    return outcome, result.miss_reason if outcome.word == MISS else None


def unstreamed_tail(streamed: str, result: GenerationResult) -> str:
    """Text of the final result not yet sent as deltas (e.g. held back by a decoder)."""
    if result.text.startswith(streamed):
        return result.text[len(streamed):]
    return ""


def cache_creation_tokens(result: GenerationResult) -> int:
    """Prompt tokens this request stored: its uncached prompt part, when it saved any
    prompt block (mid-prefill or end-of-prefill save points); else 0."""
    u = result.usage
    if u.saved_mid_prefill + u.saved_end_prefill > 0:
        return max(0, u.prompt_tokens - u.cached_tokens)
    return 0


def state_of(request: Request) -> ServerState:
    """The app's ``ServerState``."""
    st: ServerState = request.app.state.pc
    return st


def standard_subscribers(s: ServerState) -> list[Subscriber]:
    """The operations' subscribers of one app, in the order they run."""

    def monitor(ev: RequestFinished) -> None:
        if ev.served:
            s.monitor.record(ev.outcome)

    def session_stats(ev: RequestFinished) -> None:
        if ev.served:
            s.session_stats.record(ev.scope, ev.usage.prompt_tokens, ev.usage.cached_tokens)

    def session_ttl(ev: RequestFinished) -> None:
        if s.sessions is not None and not ev.failed:
            s.sessions.touch(ev.scope.tenant, ev.scope.session_id)

    def history(ev: RequestFinished) -> None:
        if ev.served:
            miss = ev.result.miss
            s.history.record(api=ev.api, tenant=ev.tenant, session=ev.scope.session_id,
                             prompt_tokens=ev.usage.prompt_tokens,
                             cached_tokens=ev.usage.cached_tokens, ttft_s=ev.ttft_s,
                             cause=miss.cause if miss is not None else None,
                             rolling_hit_rate=s.monitor.hit_rate())

    def metrics(ev: RequestFinished) -> None:
        m, u = s.metrics, ev.usage
        m.queue_wait.observe(ev.result.queue_s)
        if ev.failed:
            m.observe_failure(ev.api, "error")
            return
        if ev.result.finish_reason == "cancelled":
            m.observe_failure(ev.api, "cancelled")
        else:
            m.observe_result(ev.api, u.prompt_tokens, u.cached_by_tier, u.completion_tokens,
                             ev.ttft_s)
        rate = s.monitor.hit_rate()
        if rate is not None:
            m.rolling_hit_rate.set(rate)
        m.alert.set(1 if s.monitor.alerting else 0)

    return [monitor, session_stats, session_ttl, history, metrics, log_line]
