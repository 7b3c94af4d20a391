"""Per-session and per-agent request counts (``"sessions"`` in ``GET /v1/cache/stats``),
bounded by ``max_sessions`` (least recently active dropped) and ``max_agents`` per session
(more under ``other_agents``), so made-up ids cannot grow memory."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from ...lru import BoundedLRU
from ..api.auth import Scope

MAX_SESSIONS = 256
MAX_AGENTS = 32


@dataclass
class _Counts:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def add(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    def to_dict(self) -> dict[str, int]:
        return {"requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens}


@dataclass
class _Agent(_Counts):
    parent_agent_id: str | None = None


@dataclass
class _Session(_Counts):
    agents: dict[str, _Agent] = field(default_factory=dict)
    other_agents: _Counts = field(default_factory=_Counts)


class SessionStats:
    def __init__(self, max_sessions: int = MAX_SESSIONS, max_agents: int = MAX_AGENTS) -> None:
        if max_sessions < 1 or max_agents < 0:
            raise ValueError("max_sessions must be >= 1 and max_agents >= 0")
        self.max_sessions = max_sessions
        self.max_agents = max_agents
        self._sessions: BoundedLRU[tuple[str, str], _Session] = BoundedLRU(max_sessions)
        self._evicted = 0
        self._lock = threading.Lock()

    def record(self, scope: Scope, prompt_tokens: int, cached_tokens: int) -> None:
        """Count one finished request of ``scope`` (nothing without a session)."""
        if scope.session_id is None:
            return
        key = (scope.tenant, scope.session_id)
        with self._lock:
            s = self._sessions.get(key)
            if s is None:
                s = _Session()
                self._evicted += len(self._sessions.put(key, s))
            s.add(prompt_tokens, cached_tokens)
            if scope.agent_id is None:
                return
            a = s.agents.get(scope.agent_id)
            if a is None and len(s.agents) < self.max_agents:
                a = s.agents[scope.agent_id] = _Agent(parent_agent_id=scope.parent_agent_id)
            if a is None:
                s.other_agents.add(prompt_tokens, cached_tokens)
                return
            if scope.parent_agent_id is not None:
                a.parent_agent_id = scope.parent_agent_id
            a.add(prompt_tokens, cached_tokens)

    def snapshot(self, tenant_scope: str | None = None) -> dict[str, Any]:
        """The stats, most recent session first; ``tenant_scope``: that tenant's only."""
        with self._lock:
            rows = []
            for (tenant, sid), s in reversed(self._sessions.items()):
                if tenant_scope is not None and tenant != tenant_scope:
                    continue
                agents = [{"agent_id": aid, "parent_agent_id": a.parent_agent_id, **a.to_dict()}
                          for aid, a in s.agents.items()]
                rows.append({"tenant": tenant, "session_id": sid, **s.to_dict(),
                             "agents": agents, "other_agents": s.other_agents.to_dict()})
            return {"tracked": len(self._sessions) if tenant_scope is None else len(rows),
                    "max_sessions": self.max_sessions,
                    "max_agents": self.max_agents, "evicted_sessions": self._evicted,
                    "by_session": rows}
