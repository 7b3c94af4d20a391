"""`promptcache serve`: load a model into an Engine and serve the OpenAI/Anthropic APIs.
Without ``--model`` the embedded default model is prepared and served. The SSD tier is on by
default (under ``--cache-dir``; ``--no-ssd``: RAM only, ``--no-cache``: no caching); every stored
block is written to it asynchronously (``--ssd-policy write_back``: only evicted ones), and a clean
shutdown writes what it lacks. Several servers may share one ``--cache-dir``."""


from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING

from ..config import MIN_KV_BUDGET, memory_limit  # noqa: F401 (re-exported)
from .progress import StepLines
from .serve_args import add_arguments
from .serve_config import (  # noqa: F401 (re-exported: callers import them from here)
    build_configs,
    build_redis_config,
    build_vision_cache,
    model_of,
    read_chat_template,
    resolve_model,
)

if TYPE_CHECKING:
    import uvicorn

    from ..config import CacheConfig, RedisConfig, SSDConfig
    from ..engine.engine import Engine
    from ..engine.models.vision_cache import VisionCache
    from ..engine.steps import Steps
    from ..serving_config import EngineConfig

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="serve the OpenAI/Anthropic-compatible API",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def check_port(host: str, port: int) -> None:
    """ValueError (one line) when ``host:port`` cannot be listened on: bound and closed
    again as uvicorn binds it (SO_REUSEADDR), before anything slow is loaded."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"cannot serve on {host}:{port}: the address is already in "
                                 "use (another server?); pick another --port") from None
            raise ValueError(f"cannot serve on {host}:{port}: {e.strerror or e}") from None


def start_engine(model: str | None, engine_cfg: EngineConfig, cache_cfg: CacheConfig,
                 ssd_cfg: SSDConfig | None, redis_cfg: RedisConfig | None, *,
                 vision_cache: VisionCache | None = None, chat_template: str | None = None,
                 steps: Steps) -> tuple[Engine, str | None]:
    """The engine serve serves and its SSD tier's mode: the model resolved (None or
    ``default``: the embedded default, fetched and converted once), the cache opened,
    the model loaded; each long step a line when it starts and when it ends."""
    from ..engine.engine import Engine
    from ..errors import TemplateRenderError
    from .wiring import build_cache

    model = resolve_model(model, steps)
    print(f"promptcache: loading {model}", file=sys.stderr, flush=True)
    if ssd_cfg is not None:
        with steps(f"opening the SSD tier ({ssd_cfg.path})"):
            cache = build_cache(cache_cfg, ssd_cfg, redis_cfg)
    else:
        cache = build_cache(cache_cfg, ssd_cfg, redis_cfg)
    ssd_mode = {t.name: getattr(t, "mode", "") for t in cache.lower}.get("ssd") if cache else None
    try:
        engine = Engine.load(model, engine_cfg, cache_cfg, cache=cache,
                             vision_cache=vision_cache, chat_template=chat_template,
                             steps=steps)
    except TemplateRenderError as e:  # the startup test render: one line, no traceback
        if cache is not None:
            cache.close(persist=False)
        whose = "--chat-template" if chat_template is not None else f"the chat template of {model}"
        raise ValueError(f"{whose}: {e}") from None
    return engine, ssd_mode


def run(args: argparse.Namespace) -> int:
    logging.getLogger().setLevel(args.log_level.upper())
    model = model_of(args)
    engine_cfg, cache_cfg, ssd_cfg, server_cfg = build_configs(args)
    check_port(args.host, args.port)
    redis_cfg = build_redis_config(args)
    chat_template = read_chat_template(args.chat_template)

    from .openblas import missing_warning

    blas_warning = missing_warning()
    if blas_warning is not None:
        print(blas_warning, file=sys.stderr)

    import uvicorn

    from ..server import create_app
    from ..server.edge import edge_protocol, fit_to_fd_limit

    engine, ssd_mode = start_engine(model, engine_cfg, cache_cfg, ssd_cfg, redis_cfg,
                                    vision_cache=build_vision_cache(args, ssd_cfg),
                                    chat_template=chat_template, steps=StepLines())
    if server_cfg.context_window and server_cfg.context_window > engine.context_length:
        log.warning("--context-window %d is larger than the model's window (%d); using %d",
                    server_cfg.context_window, engine.context_length, engine.context_length)
    try:
        app = create_app(engine, server_cfg, engine_config=engine_cfg,
                         model_aliases=args.model_alias)
        if engine_cfg.memory_limit_bytes is not None:
            import psutil  # type: ignore[import-untyped]

            total = psutil.virtual_memory().total
            print(f"promptcache: memory limit {engine_cfg.memory_limit_bytes / 1e9:.1f} GB "
                  f"({engine_cfg.memory_limit_bytes / total:.0%} of "
                  f"{total / 1e9:.1f} GB physical; --memory-limit)", file=sys.stderr)
        print(f"promptcache: serving {engine.model_id} on http://{args.host}:{args.port} "
              f"(cache: {'off' if args.no_cache else 'RAM' + (' + SSD ' + str(ssd_cfg.path) + (f' ({ssd_mode})' if ssd_mode != 'read_write' else '') if ssd_cfg else '') + (' + Redis' if redis_cfg else '')}"
              f"{f', KV {args.kv_bits}-bit' if args.kv_bits and not args.no_cache else ''}; "
              f"{engine_cfg.max_active_requests} active / {engine_cfg.max_queued_requests} queued, "
              f"active KV <= {engine_cfg.active_kv_budget_bytes} bytes)",
              file=sys.stderr)
        names = [engine.model_id, *sorted(set(app.state.pc.aliases) - {engine.model_id})]
        print("\n".join(client_lines(args.host, args.port, names)), file=sys.stderr, flush=True)
        max_connections, backlog = fit_to_fd_limit(server_cfg.edge.max_connections)
        edge = dataclasses.replace(server_cfg.edge, max_connections=max_connections)
        protocol = edge_protocol(edge)
        app.state.pc.metrics.watch_edge(protocol.edge.counts)  # /metrics
        config = uvicorn.Config(app, host=args.host, port=args.port,
                                log_level=args.log_level, timeout_graceful_shutdown=5,
                                http=protocol, backlog=backlog, ws="none",
                                h11_max_incomplete_event_size=edge.max_header_bytes)
        with _terminate_raises():
            started = _serve_uvicorn(config)
        if not started:
            raise ValueError(f"cannot serve on {args.host}:{args.port} (see the log above)")
    except (_Terminated, KeyboardInterrupt):
        pass  # a clean shutdown: the cache is persisted below
    finally:
        # a second SIGINT / SIGTERM while the cache is being persisted ends the process
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        log.info("shutting down: closing the engine and persisting the cache")
        if cache_cfg.persist_timeout_s is not None:
            _watchdog.extend(cache_cfg.persist_timeout_s + SHUTDOWN_LIMIT_S)
        engine.close()
        _watchdog.closed()
    return 0


# From the first SIGTERM / SIGINT the process ends within this many seconds, whatever
# is stuck (a preparation thread in a template's render, a disk that does not answer):
# the graceful part runs first (uvicorn's 5 s, the engine's close); the cache's persist
# (bounded by --shutdown-persist-timeout, logging its progress) extends the limit while
# it runs; past the limit ``os._exit`` (0 if the engine was closed, else 1).
SHUTDOWN_LIMIT_S = 9.0
# once the engine is closed, what is left (threads joined at exit) gets this long
EXIT_GRACE_S = 1.0


class _ExitWatchdog:
    """Ends the process at a deadline set from the first exit signal (``arm``), moved
    by ``extend`` / ``closed``; a daemon thread, so a normal exit never waits for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self.engine_closed = False

    def arm(self, limit_s: float = SHUTDOWN_LIMIT_S) -> None:
        with self._lock:
            if self._deadline is not None:
                return
            self._deadline = time.monotonic() + limit_s
        threading.Thread(target=self._watch, name="promptcache-exit-watchdog",
                         daemon=True).start()

    def extend(self, seconds: float) -> None:
        """Allow ``seconds`` more from now (bounded work with progress: the persist)."""
        with self._lock:
            if self._deadline is not None:
                self._deadline = max(self._deadline, time.monotonic() + seconds)

    def closed(self) -> None:
        """The engine is closed: what is left gets ``EXIT_GRACE_S``."""
        with self._lock:
            self.engine_closed = True
            if self._deadline is not None:
                self._deadline = min(self._deadline, time.monotonic() + EXIT_GRACE_S)

    def _watch(self) -> None:
        while True:
            with self._lock:
                left = (self._deadline or 0.0) - time.monotonic()
                code = 0 if self.engine_closed else 1
            if left <= 0:
                break
            time.sleep(min(left, 0.1))
        log.error("shutdown past its time limit (a stuck thread?): exiting now (%d)", code)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        os._exit(code)


_watchdog = _ExitWatchdog()


def _arm_exit_watchdog() -> None:
    _watchdog.arm()


def _serve_uvicorn(config: uvicorn.Config) -> bool:
    """``uvicorn.Server(config).run()`` whose exit signal also arms the exit watchdog;
    whether the server started."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            _arm_exit_watchdog()
            super().handle_exit(sig, frame)

    server = Server(config)
    server.run()
    return bool(server.started)


class _Terminated(Exception):
    """SIGTERM, raised in the main thread once uvicorn has shut down."""


@contextlib.contextmanager
def _terminate_raises() -> Iterator[None]:
    """uvicorn handles SIGTERM by shutting down gracefully and then re-raising the
    signal, whose default action would end the process before the cache is persisted:
    turn it into an exception instead, so the ``finally`` above runs."""

    def raise_terminated(signum: int, frame: object) -> None:
        _arm_exit_watchdog()
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def client_lines(host: str, port: int, model_names: list[str]) -> list[str]:
    """serve's last lines: what a client needs (the base URLs of both dialects, the model
    names the server answers to, the dashboard)."""
    base = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    return [f"promptcache: OpenAI clients (OPENAI_BASE_URL): {base}/v1",
            f"promptcache: Anthropic clients (ANTHROPIC_BASE_URL): {base}",
            f"promptcache: model names: {', '.join(model_names)}",
            f"promptcache: dashboard: {base}/dashboard"]
