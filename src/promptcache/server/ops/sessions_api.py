"""``GET /v1/cache/sessions[?tenant=T]``: the sessions with cached blocks (docs/api.md):
per tier ``{"blocks", "bytes"}``, ``last_use`` (wall-clock; None if unknown) and, under
``--session-ttl``, ``expires_at``. A tenant-bound key lists its own tenant only."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from ..replies.runner import ServerState, state_of

router = APIRouter()


def session_rows(st: ServerState, tenant: str | None) -> list[dict[str, Any]]:
    cache = st.engine.cache
    if cache is None:
        return []
    rows: list[dict[str, Any]] = cache.sessions(tenant)
    reaper = st.sessions
    for r in rows:
        seen = reaper.last_use(r["tenant"], r["session_id"]) if reaper is not None else None
        known = [t["last_use"] for t in r["tiers"].values() if "last_use" in t]
        if seen is not None:
            known.append(seen)
        r["last_use"] = max(known) if known else None
        r["blocks"] = max((t["blocks"] for t in r["tiers"].values()), default=0)
        if reaper is not None:
            r["expires_at"] = None if r["last_use"] is None else r["last_use"] + reaper.ttl_s
    return rows


@router.get("/v1/cache/sessions")
async def list_sessions(request: Request, tenant: str | None = None) -> dict[str, Any]:
    st = state_of(request)
    tenant = st.auth.query_tenant(request, tenant, "list its own tenant's sessions")
    rows = await run_in_threadpool(session_rows, st, tenant)
    out: dict[str, Any] = {"sessions": rows, "tenant": tenant}
    if st.sessions is not None:
        out["session_ttl"] = st.sessions.snapshot()
    return out
