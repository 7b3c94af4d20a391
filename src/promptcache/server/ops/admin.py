"""Admin endpoints: cache stats and deletion, health, Prometheus metrics. ``/health`` and
``/metrics`` need no API key; ``/v1/cache*`` does, and a tenant-bound key sees and
deletes only its own tenant (``DELETE /v1/cache`` then deletes that tenant's blocks)."""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ...advisor import diagnose
from ...engine.port import EngineAPI
from ..api.auth import validate_session_id
from ..api.errors import APIError
from ..prompts.canon import parse_rules_off
from ..replies.runner import ServerState, state_of

log = logging.getLogger(__name__)
router = APIRouter()


def cache_stats_dict(engine: EngineAPI) -> dict[str, Any] | None:
    """The cache's stats with its levels; None without a cache."""
    return engine.cache_port.cache_stats()


def kv_stats_dict(engine: EngineAPI) -> dict[str, Any] | None:
    """Arrays and bytes per cached token, the KV quantization (if the engine reports them)."""
    got = engine.cache_port.kv_stats()
    return dict(got) if got is not None else None


def engine_stats_dict(engine: EngineAPI) -> dict[str, Any] | None:
    """The engine's own numbers (active KV bytes, queue, waits, batch), if it has them."""
    got = engine.engine_stats()
    return dict(got) if got is not None else None


def _prerender_stats(st: ServerState) -> dict[str, Any] | None:
    pre = st.prerender
    return pre.snapshot() if pre is not None else None


_PLAIN = ("mode", "state")  # the tiers' string fields that are enums, never free text


def _has_valid_key(st: ServerState, request: Request) -> bool:
    if not st.auth.enabled:
        return False
    try:
        st.auth.key_tenant(request)
    except APIError:
        return False
    return True


@router.get("/health", response_model=None)
async def health(request: Request) -> dict[str, Any] | JSONResponse:
    """Liveness: 200 while the engine thread runs, 503 once it died. No lock, no engine
    call. Free text (may name paths) only for a caller with a valid API key."""
    st = state_of(request)
    detail = _has_valid_key(st, request)
    body: dict[str, Any] = {
        "status": "ok", "model": st.model_id,
        "cache_enabled": st.engine.cache is not None,
        "uptime_s": round(time.time() - st.started_at, 3)}
    tiers = st.engine.cache_port.tier_health()
    if tiers:
        body["tiers"] = tiers if detail else {
            name: {k: v for k, v in entry.items() if not isinstance(v, str) or k in _PLAIN}
            for name, entry in tiers.items()}
    if not st.engine.alive:
        body["status"] = "engine_dead"
        body["error"] = st.engine.failure if detail else "the engine thread has died"
        return JSONResponse(body, status_code=503)
    return body


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    st = state_of(request)
    body = await run_in_threadpool(st.metrics.render)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def stats_payload(st: ServerState, tenant: str | None = None) -> dict[str, Any]:
    """The body of ``GET /v1/cache/stats`` (and the dashboard's), in a worker thread (the
    stats take the cache lock). ``tenant``: a tenant-bound key's, its sessions only."""
    try:
        stats = cache_stats_dict(st.engine)
        kv = kv_stats_dict(st.engine)
        error = None
    except Exception as e:  # a broken cache must not break the admin view
        log.warning("cache stats failed", exc_info=True)
        stats, kv, error = None, None, f"{type(e).__name__}: {e}"
    out: dict[str, Any] = {
        "model": st.model_id,
        "cache_enabled": st.engine.cache is not None,
        "cache": stats,
        "kv": kv,
        "engine": engine_stats_dict(st.engine),
        "rolling": st.monitor.snapshot(),
        "prerender": _prerender_stats(st),
        "alert": {"active": st.monitor.alerting, "threshold": st.monitor.threshold,
                  # no alert is raised before the window holds this many requests
                  "min_requests": st.monitor.min_samples},
        "sessions": st.session_stats.snapshot(tenant),
    }
    vision = st.engine.vision_stats()
    if vision is not None:  # a vision-language model: the vision-embedding cache's line
        out["vision"] = vision
    shadow = st.engine.shadow
    if shadow is not None:  # engine/payload/shadow.py: a mismatch raises the alert too
        out["shadow"] = shadow.snapshot()
        out["alert"]["shadow_mismatch"] = bool(shadow.alerting)
        out["alert"]["active"] = bool(out["alert"]["active"] or shadow.alerting)
    if st.advisor is not None:
        out["diagnosis"] = diagnosis_of(st, stats)
    if st.tuner is not None:
        out["auto_tune"] = st.tuner.snapshot()
    if error:
        out["error"] = error
    return out


def diagnosis_of(st: ServerState, stats: dict[str, Any] | None = None) -> dict[str, Any]:
    """The automated diagnosis (``advisor.diagnose``) over the advisor's window."""
    if stats is None:
        stats = cache_stats_dict(st.engine)
    adv = st.advisor
    if adv is None:
        return {}
    d = diagnose(adv.window(), stats, recommended_budget=adv.recommended_budget(),
                 missed=st.monitor.missed_by_cause(),
                 canonical_off=parse_rules_off(st.config.canonicalize_off))
    d["alerting"] = st.monitor.alerting
    return d


@router.get("/v1/cache/stats")
async def cache_stats(request: Request) -> dict[str, Any]:
    st = state_of(request)
    tenant = st.auth.key_tenant(request)  # None: a global key, or no keys configured
    return await run_in_threadpool(stats_payload, st, tenant)


@router.delete("/v1/cache")
async def delete_cache(request: Request, tenant: str | None = None) -> dict[str, Any]:
    st = state_of(request)
    tenant = st.auth.query_tenant(request, tenant, "delete its own tenant's cache")
    cache = st.engine.cache
    if cache is None:
        return {"deleted_blocks": 0, "tenant": tenant, "cache_enabled": False}
    n = await run_in_threadpool(cache.delete, tenant)
    log.info("deleted %d cached blocks (tenant=%s)", n, tenant or "*")
    return {"deleted_blocks": int(n), "tenant": tenant, "cache_enabled": True}


@router.delete("/v1/cache/sessions/{session_id}")
async def delete_session(session_id: str, request: Request,
                         tenant: str | None = None) -> dict[str, Any]:
    """Delete one session's blocks within one tenant (``Authenticator.deletion_tenant``)."""
    st = state_of(request)
    try:
        validate_session_id(session_id)
    except ValueError as e:
        raise APIError(400, str(e), param="session_id") from e
    scope = st.auth.deletion_tenant(request, tenant)
    cache = st.engine.cache
    if cache is None:
        return {"deleted_blocks": 0, "session_id": session_id, "cache_enabled": False}
    if scope is None:
        n = await run_in_threadpool(cache.delete_session, session_id)
    else:
        n = await run_in_threadpool(cache.delete_session, session_id, scope)
    log.info("deleted %d cached blocks of session %s (tenant=%s)", n, session_id, scope or "*")
    out: dict[str, Any] = {"deleted_blocks": int(n), "session_id": session_id,
                           "cache_enabled": True}
    if scope is not None:
        out["tenant"] = scope
    return out
