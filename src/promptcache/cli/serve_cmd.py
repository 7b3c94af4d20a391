"""`promptcache serve`: load a model into an Engine and serve the OpenAI/Anthropic APIs.

Without ``--model`` the embedded default model is prepared (offline) and served.
The SSD tier is on by default (under ``--cache-dir``, default
``config.default_cache_dir()/blocks``); ``--no-ssd`` keeps the cache in RAM only and
``--no-cache`` disables caching entirely (for comparisons).

The server writes every stored block to the SSD asynchronously (``write_through``): a
block that finds the writer's queue full waits in RAM and is written as the queue
drains, so a crash or ``kill -9`` loses only blocks not written yet. ``--ssd-policy
write_back`` writes only blocks evicted from RAM (fewer SSD writes). Either way a
clean shutdown (SIGINT / SIGTERM) writes every RAM block the SSD lacks, within
``--shutdown-persist-timeout`` seconds; whatever is stuck (a template's render, a
disk), the process ends within 9 s of the signal, plus the time that persist takes.
Several servers may share one ``--cache-dir``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from ..config import CacheConfig, RedisConfig, SSDConfig, parse_size
from ..serving_config import EdgeLimits, EngineConfig, ImageLimits, ServerConfig

if TYPE_CHECKING:
    import uvicorn

    from ..engine.vision_cache import VisionCache

log = logging.getLogger(__name__)

MIN_KV_BUDGET = 256 * 1024**2


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="serve the OpenAI/Anthropic-compatible API",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="the model, as --model (the spelling of `vllm serve MODEL`)")
    p.add_argument("--model", help="local model folder or Hugging Face repo id "
                                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) that "
                        "replaces the model's, e.g. one that renders tools for a model "
                        "whose own template drops them")
    p.add_argument("--template-render-limit", type=float,
                   default=EngineConfig.template_render_limit_s, metavar="SECONDS",
                   help="a chat template's render that runs longer is stopped and its "
                        "request answered with a 500 (a template that loops); the startup "
                        "test render too (default %(default)s)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="SSD tier folder (default: <promptcache home>/blocks)")
    p.add_argument("--ram-budget", default=None,
                   help="RAM tier budget: 512MB, 4GB or 20%% of available RAM (default 20%%)")
    p.add_argument("--max-arrays", type=int, default=CacheConfig.max_arrays, metavar="N",
                   help="MLX arrays the RAM tier may hold (one per block): Metal caps a "
                        "process's buffers at ~499,000 whatever their bytes (default "
                        f"{CacheConfig.max_arrays})")
    p.add_argument("--ssd-budget", default="10GB",
                   help="SSD tier budget: 10GB, or a %% of the free disk space")
    p.add_argument("--block-size", type=int, default=64, help="tokens per cache block")
    p.add_argument("--ssd-policy", choices=("write_through", "write_back"),
                   default="write_through",
                   help="write_through: persist blocks as they are stored (survives kill -9); "
                        "write_back: only evicted blocks, the rest at a clean shutdown")
    p.add_argument("--ssd-queue-size", type=int, default=SSDConfig.queue_size,
                   help="blocks waiting for the SSD writer; more wait in RAM, never dropped "
                        "(default %(default)s)")
    p.add_argument("--shutdown-persist-timeout", type=float,
                   default=CacheConfig.persist_timeout_s,
                   help="seconds a clean shutdown may spend writing the RAM blocks the SSD "
                        "lacks (default %(default)s; what is left is logged by name)")
    p.add_argument("--kv-bits", type=int, choices=(8, 4), default=None,
                   help="store cached blocks quantized to 8 or 4 bits (every tier; "
                        "default: full precision); dequantized on restore")
    p.add_argument("--kv-group-size", type=int, choices=(32, 64, 128), default=64,
                   help="values per quantization scale/bias (default 64)")
    p.add_argument("--kv-quant-min-tokens", type=int, default=256,
                   help="blocks starting before this token stay full precision (default 256)")
    p.add_argument("--ttl", default=None,
                   help="drop cached blocks unused for this long, in RAM and on the SSD "
                        "(30m, 12h, 7d; default: kept until evicted)")
    p.add_argument("--session-ttl", default=None,
                   help="delete sessions unused for this long from every tier (blocks "
                        "shared with a live session stay; 1h, 7d; default: kept)")
    p.add_argument("--auto-tune", action="store_true",
                   help="move the RAM budget within --ram-budget-min/max from memory "
                        "pressure and the evicted-before-reuse rate (logs every change)")
    p.add_argument("--ram-budget-min", default=None,
                   help="auto-tune lower bound (512MB, 5%%; default: 100MB or the budget)")
    p.add_argument("--ram-budget-max", default=None,
                   help="auto-tune upper bound (8GB, 40%%; default: twice the budget)")
    p.add_argument("--no-ssd", action="store_true", help="RAM tier only")
    p.add_argument("--no-cache", action="store_true", help="disable the prompt cache")
    p.add_argument("--redis-url", default=None,
                   help="shared tier on Redis / Valkey: redis://, rediss://, unix:// or "
                        "redis+cluster://HOST:PORT (several servers reuse each other's blocks)")
    p.add_argument("--redis-cluster", action="store_true",
                   help="the --redis-url names a Redis Cluster node")
    p.add_argument("--redis-ttl", default="24h", help="TTL of every Redis key (24h, 7d, 3600)")
    p.add_argument("--redis-timeout-ms", type=float, default=50.0,
                   help="per-operation timeout on the request path (default 50)")
    p.add_argument("--redis-prefix", default="promptcache", help="key prefix")
    p.add_argument("--api-key", default=None, help="require this key (Bearer or x-api-key)")
    p.add_argument("--api-keys-file", type=Path, default=None,
                   help='JSON object {"<key>": "<tenant>"}: keys that select a tenant')
    p.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help="browser origins allowed to call the server (CORS): a comma list "
                        "(https://app.example.com,http://localhost:3000) or *; default: "
                        "none (no CORS headers)")
    p.add_argument("--model-alias", "--served-model-name", action="append", default=[],
                   help="extra model name to accept (repeatable), e.g. a name a client "
                        "insists on; replies still name the model")
    p.add_argument("--hit-rate-window", type=int, default=50,
                   help="requests in the rolling hit-rate window")
    p.add_argument("--hit-rate-threshold", type=float, default=0.8,
                   help="warn when the rolling token hit rate drops below this")
    p.add_argument("--max-tokens-limit", type=int, default=EngineConfig.max_tokens_limit,
                   help="the largest max_tokens of a request (default "
                        f"{EngineConfig.max_tokens_limit}); a larger one is clamped to it, "
                        "or refused with --max-tokens-overflow error")
    p.add_argument("--default-max-tokens", type=int, default=EngineConfig.default_max_tokens,
                   help="max_tokens of a request that gives none (within the room left)")
    p.add_argument("--context-window", "--max-model-len", type=int, default=None,
                   help="the context window to enforce (default: the model's; may only "
                        "shrink it)")
    p.add_argument("--max-tokens-overflow", choices=("clamp", "error"), default="clamp",
                   help="prompt + max_tokens past the window, or max_tokens past the "
                        "limit: clamp max_tokens to the room left (default), or answer "
                        "with the APIs' context-limit error")
    p.add_argument("--no-canonicalize", action="append", default=[], metavar="RULE",
                   help="switch a canonical-prompt rule off (repeatable): billing_header, "
                        "tool_keys, tool_order, or all")
    p.add_argument("--no-prerender", action="store_true",
                   help="do not pre-render the next turn's prefix in idle time")
    p.add_argument("--prerender-max-pending", type=int, default=4,
                   help="next-turn pre-renders queued or running at once (default 4)")
    p.add_argument("--protect-share", type=float, default=CacheConfig.protect_share,
                   help="share of the RAM budget that cache_control breakpoints and "
                        "prompt_cache_key chains may keep from eviction (default 0.25)")
    p.add_argument("--session-active-minutes", type=float, default=10.0,
                   help="a session's latest chain is evicted only after idle chains while "
                        "it sent a request in the last N minutes (default 10; 0: off)")
    p.add_argument("--log-requests", type=Path, default=None, metavar="DIR",
                   help="debug: write every /v1 request (secrets left out) as JSON into DIR")
    p.add_argument("--shadow-verify", type=float, default=0.0, metavar="FRACTION",
                   help="recompute this fraction of cache hits in idle time and compare "
                        "them with the stored blocks; a mismatch quarantines the chain "
                        "(default 0: off)")
    p.add_argument("--speculation", choices=["suffix", "off"],
                   default=EngineConfig.speculation,
                   help="speculative decoding drafted from the request's own history, "
                        "then its tenant's recent replies; a verify runs only where the "
                        "gate expects it to pay (default suffix)")
    p.add_argument("--spec-max-draft", type=int, default=EngineConfig.spec_max_draft,
                   help="most draft tokens verified per forward (default 8)")
    p.add_argument("--spec-pool-tokens", type=int, default=EngineConfig.spec_pool_tokens,
                   help="tokens of finished requests kept as drafts, over all tenants' "
                        "pools (about 1 KB each; 0: no pool; default "
                        f"{EngineConfig.spec_pool_tokens})")
    p.add_argument("--spec-verify-cost", default="auto", metavar="auto|X|C1,C2,...",
                   help="what the speculation gate takes a verify forward of k draft tokens "
                        "to cost: 'auto' (measured at startup, corrected by the verify "
                        "forwards timed while serving), a number X (fixed: 1 + X*k decode "
                        "steps) or a comma list (fixed: the cost at k = 1, 2, ... in decode "
                        "steps; the last slope continues); default auto")
    p.add_argument("--spec-max-slowdown", type=float,
                   default=EngineConfig.spec_max_slowdown, metavar="F",
                   help="how much slower a verify forward may make a row that gains "
                        "nothing from it (a request with nothing to copy, batched with "
                        "rows that copy): beyond the steps its own drafts saved it, at "
                        "most F x the tokens it decoded (default 0: never slower; larger: "
                        "more speculation for the rows that copy)")
    p.add_argument("--live-states", type=int, default=EngineConfig.live_states, metavar="N",
                   help="the caches of the last N finished turns stay as the model's own "
                        "objects, so a next turn that extends one restores nothing "
                        "(counted in --ram-budget, released before its active blocks; "
                        f"0: off; default {EngineConfig.live_states})")
    p.add_argument("--max-body-bytes", default="32MB",
                   help="largest /v1 request body; a larger one gets 413 before it is "
                        "read (default 32MB, as the hosted APIs)")
    p.add_argument("--max-import-bytes", default="2GB",
                   help="largest cache pack POST /v1/cache/import accepts: streamed to a "
                        "temp file beside the SSD tier, refused with 413 once past it "
                        "(default 2GB)")
    p.add_argument("--header-timeout", type=float, default=EdgeLimits.header_timeout_s,
                   metavar="SECONDS",
                   help="close a connection that has not sent a whole request head this "
                        "long after it opened (or after its next request began); default "
                        "%(default)s")
    p.add_argument("--max-connections", type=int, default=EdgeLimits.max_connections,
                   help="open connections at most; past it idle keep-alive connections "
                        "are closed first, then the ones still sending a head (oldest "
                        "first), and with every one busy a new one gets 503; lowered to "
                        "fit the file descriptor limit (default %(default)s)")
    p.add_argument("--max-active", type=int, default=EngineConfig.max_active_requests,
                   help="requests admitted at once (prefilling + decoding)")
    p.add_argument("--max-queue", type=int, default=EngineConfig.max_queued_requests,
                   help="requests waiting for admission; more get 429 / 529 + Retry-After")
    p.add_argument("--kv-budget", default="10%",
                   help="bytes of KV the active requests may hold (batch padding included): "
                        "2GB or a %% of available RAM (default 10%%; the RAM tier budget is "
                        "separate, so KV memory stays under ram-budget + kv-budget)")
    p.add_argument("--memory-limit", default="75%", metavar="SIZE|%|off",
                   help="the process's footprint (macOS phys_footprint, Linux RSS) is kept "
                        "under this: past 85%% of it MLX's buffer pool, the live states and "
                        "the RAM tier give memory back and admission pauses, past 95%% new "
                        "requests get 429 / 529 with Retry-After; 8GB or a %% of physical "
                        "memory (default 75%%; off: no limit)")
    g = p.add_argument_group("images (vision-language models, promptcache[vlm])")
    g.add_argument("--allow-local-images", action="store_true",
                   help="read image parts that name a local file (absolute path / file://)")
    g.add_argument("--allow-image-urls", action="store_true",
                   help="fetch http(s) image URLs (within --max-image-bytes, 10 s timeout)")
    g.add_argument("--max-images", type=int, default=ImageLimits.max_images,
                   help="images per request")
    g.add_argument("--max-image-bytes", default="20MB", help="encoded size of one image")
    g.add_argument("--max-image-pixels", type=int, default=ImageLimits.max_pixels,
                   help="width x height of one image (checked before decoding)")
    g.add_argument("--vision-cache-budget", default="256MB",
                   help="RAM for cached vision features (digest -> features); 0 disables")
    g.add_argument("--vision-cache-dir", type=Path, default=None,
                   help="folder for persisted vision features (default: <cache-dir>-vision "
                        "when the SSD tier is on)")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def build_configs(args: argparse.Namespace) -> tuple[
        EngineConfig, CacheConfig, SSDConfig | None, ServerConfig]:
    """Validate the options into configs (ValueError on bad values)."""
    import psutil  # type: ignore[import-untyped]

    from ..server.prompts.canon import parse_rules_off

    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.hit_rate_window < 1:
        raise ValueError(f"--hit-rate-window must be >= 1, got {args.hit_rate_window}")
    if not 0.0 <= args.hit_rate_threshold <= 1.0:
        raise ValueError(f"--hit-rate-threshold must be in [0, 1], got {args.hit_rate_threshold}")
    ram = None
    if args.ram_budget is not None:
        ram = parse_size(args.ram_budget, total=psutil.virtual_memory().available)
    if args.shutdown_persist_timeout < 0:
        raise ValueError(f"--shutdown-persist-timeout must be >= 0, got {args.shutdown_persist_timeout}")
    if args.session_active_minutes < 0:
        raise ValueError(f"--session-active-minutes must be >= 0, got {args.session_active_minutes}")
    from .cache_cmd import parse_duration

    ttl = parse_duration(args.ttl) if args.ttl is not None else None
    session_ttl = parse_duration(args.session_ttl) if args.session_ttl is not None else None
    avail = psutil.virtual_memory().available
    bounds = tuple(None if v is None else parse_size(v, total=avail)
                   for v in (args.ram_budget_min, args.ram_budget_max))
    if (bounds[0] is not None or bounds[1] is not None) and not args.auto_tune:
        raise ValueError("--ram-budget-min / --ram-budget-max need --auto-tune")
    if args.kv_quant_min_tokens < 0:
        raise ValueError(f"--kv-quant-min-tokens must be >= 0, got {args.kv_quant_min_tokens}")
    cache_cfg = CacheConfig(block_size=args.block_size, ram_budget_bytes=ram,
                            enabled=not args.no_cache, ttl_seconds=ttl,
                            persist_timeout_s=args.shutdown_persist_timeout,
                            protect_share=args.protect_share,
                            active_session_s=args.session_active_minutes * 60.0 or None,
                            kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                            kv_quant_min_tokens=args.kv_quant_min_tokens,
                            max_arrays=args.max_arrays)
    ssd_cfg = None
    if not args.no_cache and not args.no_ssd:
        path = args.cache_dir if args.cache_dir is not None else SSDConfig().path
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # the tier will be off (SSDTier says why); serving goes on
            log.error("cannot create the SSD cache folder %s: %s", path, e)
        budget = parse_size(args.ssd_budget, total=free_bytes(path))
        ssd_cfg = SSDConfig(path=path, budget_bytes=budget, policy=args.ssd_policy,
                            queue_size=args.ssd_queue_size, ttl_seconds=ttl)
    chunk = max(args.block_size, (256 // args.block_size) * args.block_size)
    if args.default_max_tokens < 1:
        raise ValueError(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
    if args.max_active < 1:
        raise ValueError(f"--max-active must be >= 1, got {args.max_active}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    kv_budget = max(MIN_KV_BUDGET, parse_size(args.kv_budget,
                                              total=psutil.virtual_memory().available))
    engine_cfg = EngineConfig(prefill_chunk_tokens=chunk,
                              max_tokens_limit=args.max_tokens_limit,
                              default_max_tokens=args.default_max_tokens,
                              max_active_requests=args.max_active,
                              max_queued_requests=args.max_queue,
                              active_kv_budget_bytes=kv_budget,
                              shadow_verify_fraction=args.shadow_verify,
                              speculation=args.speculation,
                              spec_max_draft=args.spec_max_draft,
                              spec_pool_tokens=args.spec_pool_tokens,
                              spec_verify_cost=args.spec_verify_cost,
                              spec_max_slowdown=args.spec_max_slowdown,
                              live_states=args.live_states,
                              template_render_limit_s=args.template_render_limit,
                              memory_limit_bytes=memory_limit(args.memory_limit))
    if args.api_keys_file is not None and not args.api_keys_file.is_file():
        raise ValueError(f"--api-keys-file {args.api_keys_file} does not exist")
    server_cfg = ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                              api_keys_file=args.api_keys_file,
                              allowed_origins=parse_origins(args.allowed_origins),
                              hit_rate_window=args.hit_rate_window,
                              hit_rate_alert_threshold=args.hit_rate_threshold,
                              context_window=args.context_window,
                              max_tokens_overflow=args.max_tokens_overflow,
                              log_requests_dir=args.log_requests,
                              max_body_bytes=parse_size(args.max_body_bytes),
                              max_import_bytes=parse_size(args.max_import_bytes),
                              import_dir=ssd_cfg.path if ssd_cfg is not None else None,
                              prerender=not args.no_prerender,
                              prerender_max_pending=args.prerender_max_pending,
                              canonicalize_off=tuple(sorted(
                                  parse_rules_off(args.no_canonicalize))),
                              images=ImageLimits(
                                  max_bytes=parse_size(args.max_image_bytes),
                                  max_pixels=args.max_image_pixels,
                                  max_images=args.max_images,
                                  allow_local_files=args.allow_local_images,
                                  allow_urls=args.allow_image_urls),
                              session_ttl_s=session_ttl, auto_tune=args.auto_tune,
                              ram_budget_min_bytes=bounds[0], ram_budget_max_bytes=bounds[1],
                              edge=EdgeLimits(header_timeout_s=args.header_timeout,
                                              max_connections=args.max_connections))
    return engine_cfg, cache_cfg, ssd_cfg, server_cfg


def memory_limit(value: str) -> int | None:
    """``--memory-limit``: bytes (a size, or a % of physical memory), None for ``off``."""
    import psutil

    if value.strip().lower() == "off":
        return None
    limit = parse_size(value, total=psutil.virtual_memory().total)
    if limit <= 0:
        raise ValueError(f"--memory-limit must be > 0 (or off), got {value!r}")
    return limit


def parse_origins(value: str | None) -> tuple[str, ...]:
    """``--allowed-origins``: a comma list of origins, or ``*`` (any origin); None: ()."""
    if value is None:
        return ()
    origins = tuple(o.strip().rstrip("/") for o in value.split(","))
    if not all(origins):
        raise ValueError(f"--allowed-origins: an empty origin in {value!r}")
    return origins


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the value itself when it is a Jinja
    template (has ``{{`` or ``{%``); ValueError otherwise (a mistyped path)."""
    if value is None:
        return None
    path = Path(value)
    if "{{" not in value and "{%" not in value:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {value}: not a readable template file "
                             f"({type(e).__name__}: {e})") from None
    else:
        text = value
    if not text.strip():
        raise ValueError(f"--chat-template {value}: the template is empty")
    try:
        import jinja2

        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: not a valid Jinja template (line {e.lineno}: "
                         f"{e.message})") from None
    return text


def free_bytes(path: Path) -> int:
    """Free bytes of the file system holding ``path`` (or its nearest existing parent);
    0 if none can be asked."""
    for p in (path, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return 0


def build_vision_cache(args: argparse.Namespace, ssd_cfg: SSDConfig | None
                       ) -> VisionCache | None:
    """The vision-embedding cache (used only if the model is a VLM): RAM budget, and a
    folder beside the SSD tier's (or ``--vision-cache-dir``)."""
    budget = parse_size(args.vision_cache_budget)
    if args.no_cache or budget <= 0:
        return None
    from ..engine.vision_cache import VisionCache

    folder = args.vision_cache_dir
    if folder is None and ssd_cfg is not None:
        folder = Path(str(ssd_cfg.path) + "-vision")
    return VisionCache(budget, folder)


def build_redis_config(args: argparse.Namespace) -> RedisConfig | None:
    """The shared tier's config, or None without ``--redis-url`` (ValueError if bad)."""
    if args.redis_url is None or args.no_cache:
        if args.redis_cluster:
            raise ValueError("--redis-cluster needs --redis-url")
        return None
    from .cache_cmd import parse_duration

    ttl = parse_duration(args.redis_ttl)
    if args.redis_timeout_ms <= 0:
        raise ValueError(f"--redis-timeout-ms must be > 0, got {args.redis_timeout_ms}")
    return RedisConfig(url=args.redis_url, cluster=args.redis_cluster, prefix=args.redis_prefix,
                       ttl_seconds=ttl, timeout_s=args.redis_timeout_ms / 1000.0)


def model_of(args: argparse.Namespace) -> str | None:
    """The model named by ``MODEL`` or ``--model`` (None: the default model);
    ValueError when they name two different ones."""
    given = {m for m in (args.model_arg, args.model) if m is not None}
    if len(given) > 1:
        raise ValueError(f"two models given ({args.model_arg} and --model {args.model}): "
                         "name it once")
    return given.pop() if given else None


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

    from ..engine.engine import Engine
    from ..server import create_app
    from ..server.edge import edge_protocol, fit_to_fd_limit
    from .wiring import build_cache

    if model is None:
        from ..engine.models.gguf import ensure_default_model

        print("promptcache: preparing the embedded default model ...", file=sys.stderr)
        model = str(ensure_default_model())
    print(f"promptcache: loading {model}", file=sys.stderr)
    cache = build_cache(cache_cfg, ssd_cfg, redis_cfg)
    ssd_mode = {t.name: getattr(t, "mode", "") for t in cache.lower}.get("ssd") if cache else None
    from ..errors import TemplateRenderError

    try:
        engine = Engine.load(model, engine_cfg, cache_cfg, cache=cache,
                             vision_cache=build_vision_cache(args, ssd_cfg),
                             chat_template=chat_template)
    except TemplateRenderError as e:  # the startup test render: one line, no traceback
        if cache is not None:
            cache.close(persist=False)
        whose = "--chat-template" if chat_template is not None else f"the chat template of {model}"
        raise ValueError(f"{whose}: {e}") from None
    if server_cfg.context_window and server_cfg.context_window > engine.context_length:
        log.warning("--context-window %d is larger than the model's window (%d); using %d",
                    server_cfg.context_window, engine.context_length, engine.context_length)
    try:
        app = create_app(engine, server_cfg, engine_config=engine_cfg,
                         model_aliases=args.model_alias)
        if engine_cfg.memory_limit_bytes is not None:
            import psutil

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
        config = uvicorn.Config(app, host=args.host, port=args.port,
                                log_level=args.log_level, timeout_graceful_shutdown=5,
                                http=edge_protocol(edge), backlog=backlog, ws="none",
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
