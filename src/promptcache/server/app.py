"""``create_app(engine, server_config)``: wiring only (routers, exception handlers, auth
middleware, dashboard, request log, ``HEAD /`` for Claude Code), with per app one
``ServerState`` (no global state), one ``Preparer`` and one Responses store."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from ..advisor import EvictionAdvisor, diagnose
from ..autotune import AutoTuner
from ..engine.port import EngineAPI
from ..serving_config import EngineConfig, ServerConfig
from ..sessions import SessionReaper
from .api import anthropic, openai, responses
from .api.auth import Authenticator, load_api_keys
from .api.errors import APIError, error_response, install_handlers
from .api.limits import BodyLimit
from .api.responses_items import ResponseStore
from .ops import admin, dashboard, packs_api, probe, sessions_api
from .ops.alerts import HitRateMonitor
from .ops.metrics import ServerMetrics
from .ops.request_log import RequestLog, first_sequence_number
from .prompts.canon import Canon, parse_rules_off
from .prompts.preparer import Preparer
from .prompts.prerender import PreRenderer
from .replies.runner import BASE_ALIASES, ServerState

log = logging.getLogger(__name__)


class ScopeMiddleware:
    """Authenticates ``/v1/*`` and sets ``request.state.pc_scope`` before routing (401 first)."""

    def __init__(self, app: ASGIApp, auth: Authenticator) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            request.state.pc_scope = self.auth.scope(request)
        except APIError as e:
            response = error_response(request, e.status, e.message, e.code, e.param)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(engine: EngineAPI, server_config: ServerConfig | None = None, *,
               engine_config: EngineConfig | None = None,
               model_aliases: Iterable[str] = ()) -> FastAPI:
    config = server_config or ServerConfig()
    keys = load_api_keys(config.api_keys_file) if config.api_keys_file else None
    auth = Authenticator(config.api_key, keys)
    state = ServerState(
        engine=engine,
        config=config,
        engine_config=engine_config or engine.engine_config,
        auth=auth,
        monitor=HitRateMonitor(config.hit_rate_window, config.hit_rate_alert_threshold),
        metrics=ServerMetrics(lambda: admin.cache_stats_dict(engine),
                              lambda: admin.engine_stats_dict(engine)),
        aliases=frozenset(BASE_ALIASES) | frozenset(a for a in model_aliases if a),
    )
    preparer = Preparer(engine, canon=Canon(parse_rules_off(config.canonicalize_off)),
                        on_template_error=state.metrics.template_error)
    if config.session_ttl_s is not None and engine.cache is not None:
        state.sessions = SessionReaper(engine.cache, config.session_ttl_s)
    cache = engine.cache_port.tunable_cache
    if cache is not None:
        advisor = EvictionAdvisor(cache)
        cache.observers.append(advisor)
        state.advisor = advisor
        # runs on the event loop: no cache lock, only the advisor's window and the budget
        state.monitor.explain = lambda missed: diagnose(
            advisor.window(), {"ram_budget_bytes": int(cache.pool.budget_bytes)},
            recommended_budget=advisor.recommended_budget(), missed=missed,
            canonical_off=preparer.canon.off).get("summary")
        if config.auto_tune:
            budget = int(cache.pool.budget_bytes)
            state.tuner = AutoTuner(
                cache, advisor,
                min_bytes=config.ram_budget_min_bytes if config.ram_budget_min_bytes
                is not None else min(budget, 100 * 1024**2),
                max_bytes=config.ram_budget_max_bytes if config.ram_budget_max_bytes
                is not None else 2 * budget)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for worker in (state.sessions, state.tuner):
            if worker is not None:
                worker.start()
        yield
        for worker in (state.sessions, state.tuner):
            if worker is not None:
                worker.close()
        preparer.close()

    app = FastAPI(title="promptcache", version="0.1.0", lifespan=lifespan,
                  description="OpenAI/Anthropic-compatible server with a multi-tier prompt cache")
    app.state.pc = state
    app.state.pc_prepare = preparer
    app.state.pc_prerender = state.prerender = PreRenderer(
        engine, preparer, enabled=config.prerender, max_pending=config.prerender_max_pending,
        max_suffix_tokens=config.prerender_max_suffix_tokens)
    app.state.pc_responses = ResponseStore(config.responses_store_size)
    install_handlers(app)

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def root() -> dict[str, Any]:
        return {"name": "promptcache", "model": state.model_id}

    app.include_router(openai.router)
    app.include_router(responses.router)
    app.include_router(anthropic.router)
    app.include_router(admin.router)
    app.include_router(probe.router)
    app.include_router(dashboard.router)
    app.include_router(packs_api.router)
    app.include_router(sessions_api.router)
    app.add_middleware(ScopeMiddleware, auth=auth)
    log_dir = config.log_requests_dir
    app.add_middleware(RequestLog, directory=log_dir,
                       first_seq=first_sequence_number(log_dir) if log_dir else 1)
    # outermost: an oversized body is refused before anything reads it
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    if config.allowed_origins:
        # outermost: preflight answered before the API key is asked, headers on every answer
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["Retry-After"])
    log.info("promptcache app ready: model=%s auth=%s", state.model_id,
             "on" if auth.enabled else "off")
    return app
