"""``RequestFinished``: one event per request the engine answered. Every operation that
accounts for finished requests subscribes to ``ServerState.finished`` (in order:
``runner.standard_subscribers``); a subscriber that raises is logged and breaks neither
the response nor the subscribers after it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..engine.api import GenerationResult, Usage
from .api.auth import Scope
from .ops.outcome import Outcome

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


def log_line(ev: RequestFinished) -> None:
    """The request's one log line."""
    result, u = ev.result, ev.usage
    if ev.failed:
        log.error("request %s failed in the engine: %s", ev.request_id, result.error)
        return
    tiers = " ".join(f"{k}={v}" for k, v in sorted(u.cached_by_tier.items())) or "-"
    # speculative decoding: draft tokens accepted / verified (only when it drafted)
    spec = f" spec={u.spec_accepted}/{u.spec_drafted}" if u.spec_drafted else ""
    spec += f" plan={u.restore_plan}" if u.restore_plan else ""
    log.info(
        "request %s api=%s tenant=%s %s prompt=%d cached=%d (%s) completion=%d "
        "ttft=%.3fs decode=%.1f tok/s finish=%s%s cache=%s%s", ev.request_id, ev.api,
        ev.tenant, ev.scope.describe(), u.prompt_tokens, u.cached_tokens,
        tiers, u.completion_tokens, ev.ttft_s or 0.0, result.decode_tps, result.finish_reason,
        spec, ev.outcome.words, f" miss={ev.note}" if ev.note else "")
