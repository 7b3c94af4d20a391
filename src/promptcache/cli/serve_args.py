"""The options of `promptcache serve`: the config dataclasses' flags (``options.opt``,
one argument group per config) and the few that are no config's."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..config import CacheConfig, RedisConfig, SSDConfig
from ..options import add_options
from ..serving_config import EdgeLimits, EngineConfig, ImageLimits, ServerConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="the model, as --model (the spelling of `vllm serve MODEL`)")
    p.add_argument("--model", help="local model folder or Hugging Face repo id "
                                   "(default, or `default`: the embedded "
                                   "SmolLM2-135M-Instruct)")
    p.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) that "
                        "replaces the model's, e.g. one that renders tools for a model "
                        "whose own template drops them")
    p.add_argument("--model-alias", "--served-model-name", action="append", default=[],
                   help="extra model name to accept (repeatable), e.g. a name a client "
                        "insists on; replies still name the model")
    p.add_argument("--no-ssd", action="store_true", help="RAM tier only")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"])
    for cls in (ServerConfig, EngineConfig, CacheConfig, SSDConfig, RedisConfig, EdgeLimits,
                ImageLimits):  # a group each, titled by its docstring
        g = p.add_argument_group((cls.__doc__ or "").rstrip("."))
        add_options(g, cls)
    # the images group: the vision cache is no config's
    g.add_argument("--vision-cache-budget", default="256MB",
                   help="RAM for cached vision features (digest -> features); 0 disables")
    g.add_argument("--vision-cache-dir", type=Path, default=None,
                   help="folder for persisted vision features (default: <cache-dir>-vision "
                        "when the SSD tier is on)")
