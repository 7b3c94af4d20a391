"""``GET /dashboard``: one live page of the cache's health. The page and its assets
(``static/``, no CDN, no build step) hold no data: they poll ``GET /v1/dashboard/data``
behind the same authentication as ``/v1`` (``/dashboard#key=KEY``: a fragment never
leaves the browser). A tenant-bound key sees only its own tenant."""

from __future__ import annotations

import logging
import time
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, Response

from ..api.errors import APIError
from ..replies.runner import ServerState, state_of
from .admin import stats_payload

log = logging.getLogger(__name__)
router = APIRouter()

_ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}


def _asset(name: str) -> bytes:
    return resources.files("promptcache.server").joinpath("static", name).read_bytes()


def engine_load(st: ServerState) -> dict[str, Any]:
    """Active and queued requests: admission control's, else those in flight (queued: None)."""
    try:
        es = st.engine.engine_stats()
        if es is not None:
            return {"active": int(es.get("active", 0)), "queued": int(es.get("queued", 0)),
                    "source": "engine"}
    except Exception:
        log.debug("engine_stats failed", exc_info=True)
    in_flight = st.metrics.registry.get_sample_value("promptcache_requests_in_flight")
    return {"active": int(in_flight or 0), "queued": None, "source": "server"}


SPEC_KEYS = ("spec_verifies", "spec_drafted", "spec_accepted", "spec_pool_drafted",
             "spec_pool_accepted", "spec_pool_tokens", "spec_acceptance_rate",
             "spec_mean_accepted", "spec_tokens_per_forward", "spec_paused",
             "spec_guard_off", "spec_grammar_cut", "spec_fill_drafted", "spec_fill_accepted",
             "spec_gated", "spec_presync_gated")


def speculation_panel(engine: Any) -> dict[str, Any] | None:
    """The engine's ``spec_*`` numbers without the prefix (None: the engine has none)."""
    if not isinstance(engine, dict) or "spec_verifies" not in engine:
        return None
    return {k.removeprefix("spec_"): engine.get(k) for k in SPEC_KEYS}


def dashboard_data(st: ServerState, tenant: str | None) -> dict[str, Any]:
    """Everything the page shows (runs in a worker thread: the cache's stats lock)."""
    out: dict[str, Any] = {
        "stats": stats_payload(st, tenant),
        "requests": st.history.summary(tenant),
        "engine": engine_load(st),
        "diagnosis": None,
        "server": {"model": st.model_id, "uptime_s": round(time.time() - st.started_at, 3),
                   "tenant_scope": tenant, "generated_at": time.time()},
    }
    out["diagnosis"] = out["stats"].get("diagnosis")
    out["speculation"] = speculation_panel(out["stats"].get("engine"))
    for panel in st.panels:  # more panels (diagnosis, sessions) plug in here
        try:
            out.update(panel(tenant))
        except Exception:
            log.warning("dashboard panel %r failed", panel, exc_info=True)
    return out


@router.get("/dashboard", include_in_schema=False)
async def dashboard_page() -> HTMLResponse:
    body = await run_in_threadpool(_asset, "dashboard.html")
    return HTMLResponse(body, headers={"Cache-Control": "no-store"})


@router.get("/dashboard/static/{name}", include_in_schema=False)
async def dashboard_asset(name: str) -> Response:
    media = _ASSETS.get(name)
    if media is None:
        raise APIError(404, f"no dashboard asset {name!r}", code="not_found")
    body = await run_in_threadpool(_asset, name)
    return Response(body, media_type=media, headers={"Cache-Control": "no-store"})


@router.get("/v1/dashboard/data")
async def data(request: Request) -> dict[str, Any]:
    st = state_of(request)
    tenant = st.auth.key_tenant(request)  # None: a global key, or no keys configured
    result: dict[str, Any] = await run_in_threadpool(dashboard_data, st, tenant)
    return result
