"""``RequestFinished``: one event per request the engine answered, and its subscribers.

``Generation`` (``runner.py``) publishes a ``RequestFinished`` when the engine's final
result arrives; every operation that accounts for finished requests subscribes to
``ServerState.finished`` instead of being called by hand. The standard subscribers, in
order (``standard_subscribers``): the hit-rate monitor (alerts), the per-session /
per-agent counts (``session_stats``), the session TTL's last use (``--session-ttl``),
the dashboard's history, the Prometheus metrics (which read the monitor's rolling hit
rate, so after it), and the request's log line. A subscriber that raises is logged and
never breaks the response, nor the subscribers after it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..engine.api import GenerationResult, Usage
from .api.auth import Scope
from .ops.outcome import Outcome

if TYPE_CHECKING:
    from .replies.runner import ServerState

log = logging.getLogger("promptcache.server.replies.runner")


@dataclass(frozen=True)
class RequestFinished:
    """A request the engine answered (stopped, cut, cancelled or failed)."""

    api: str
    request_id: str
    tenant: str
    scope: Scope
    result: GenerationResult
    # the engine's time to first token, else the first token as the server saw it
    ttft_s: float | None
    # the miss note of the log line (turns.start: the divergence from the previous turn;
    # else the engine's miss reason); None unless the outcome is a miss
    note: str | None
    # what the cache did (ops/outcome.py): the log line's ``cache=`` word, the alert's sample
    outcome: Outcome

    @property
    def usage(self) -> Usage:
        return self.result.usage

    @property
    def failed(self) -> bool:
        return self.result.finish_reason == "error"

    @property
    def served(self) -> bool:
        """Answered (not failed nor cancelled): counted in hit rates and history."""
        return self.result.finish_reason not in ("error", "cancelled")


Subscriber = Callable[[RequestFinished], None]


def publish(subscribers: list[Subscriber], event: RequestFinished) -> None:
    for sub in list(subscribers):
        try:
            sub(event)
        except Exception:  # accounting must never break the response
            log.warning("request %s: a finished-request subscriber failed", event.request_id,
                        exc_info=True)


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


def log_line(ev: RequestFinished) -> None:
    """The request's one log line."""
    result, u = ev.result, ev.usage
    if ev.failed:
        log.error("request %s failed in the engine: %s", ev.request_id, result.error)
        return
    tiers = " ".join(f"{k}={v}" for k, v in sorted(u.cached_by_tier.items())) or "-"
    # speculative decoding: draft tokens accepted / verified (only when it drafted)
    spec = f" spec={u.spec_accepted}/{u.spec_drafted}" if u.spec_drafted else ""
    log.info(
        "request %s api=%s tenant=%s %s prompt=%d cached=%d (%s) completion=%d "
        "ttft=%.3fs decode=%.1f tok/s finish=%s%s cache=%s%s", ev.request_id, ev.api,
        ev.tenant, ev.scope.describe(), u.prompt_tokens, u.cached_tokens,
        tiers, u.completion_tokens, ev.ttft_s or 0.0, result.decode_tps, result.finish_reason,
        spec, ev.outcome.words, f" miss={ev.note}" if ev.note else "")
