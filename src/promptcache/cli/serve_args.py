"""The options of `promptcache serve` (``add_arguments``: the argument parser's part;
``serve_cmd.register`` adds the command, ``serve_config.build_configs`` reads them)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..config import CacheConfig, SSDConfig
from ..serving_config import EdgeLimits, EngineConfig, ImageLimits


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
    p.add_argument("--ssd-segment-mb", type=int, default=SSDConfig.segment_bytes >> 20,
                   help="append new SSD blocks to segment files of about this many MB "
                        "(read in runs); 0: one file per block (default %(default)s)")
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
    p.add_argument("--body-timeout", type=float, default=EdgeLimits.body_timeout_s,
                   metavar="SECONDS",
                   help="answer 408 and close a request whose body has not arrived in "
                        "whole this long after its head, plus one second per 64 KiB "
                        "received (a large upload on a slow link still arrives; a body "
                        "that trickles or stops does not); default %(default)s")
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
