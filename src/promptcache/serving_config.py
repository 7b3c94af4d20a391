"""Serving configuration: the engine's generation settings, image limits and the HTTP
server. Fields declared with ``opt`` are `promptcache serve` flags (options.py)."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from pathlib import Path

from .config import kv_budget, memory_limit, parse_duration, parse_origins, parse_size, ram_share
from .options import opt


@dataclass(frozen=True)
class EngineConfig:
    """Generation: admission, prefill, speculation and memory."""

    # a multiple of the block size; each completed chunk is stored (mid-prefill save)
    prefill_chunk_tokens: int = 256
    # SSM/hybrid states: a snapshot every k blocks, and at the last N message starts
    snapshot_every_blocks: int = 4
    message_snapshots: int = 16
    max_tokens_limit: int = opt(
        "--max-tokens-limit", default=32768,
        help="the largest max_tokens of a request (default %(default)s); a larger one is "
             "clamped to it, or refused with --max-tokens-overflow error")
    default_max_tokens: int = opt(
        "--default-max-tokens", default=512,
        help="max_tokens of a request that gives none (within the room left)")
    repetition_penalty: float = opt(  # the default model's own: cli/serve_config.py
        "--repetition-penalty", default=1.0, flag_default=None,
        help="a request's repetition penalty when it gives none (mlx-lm's; 1.0 = off, the "
             "default; 1.1 on the embedded default model, which loops without one)")
    repetition_context_size: int = opt(
        "--repetition-context-size", default=20, flag_default=None,
        help="the last tokens the penalties look at (default 20; 64 on the default model)")
    # admission control (engine/requests/admission.py); the RAM tier's budget is separate
    max_active_requests: int = opt("--max-active", default=16,
                                   help="requests admitted at once (prefilling + decoding)")
    max_queued_requests: int = opt(
        "--max-queue", default=64,
        help="requests waiting for admission; more get 429 / 529 + Retry-After")
    active_kv_budget_bytes: int | None = opt(
        "--kv-budget", default=None, flag_default="10%", parse=kv_budget,
        help="bytes of KV the active requests may hold (batch padding included): 2GB or "
             "a %% of available RAM (default 10%%; the RAM tier budget is separate, so KV "
             "memory stays under ram-budget + kv-budget)")
    # the memory governor (engine/governor.py): soft and hard watermarks of the limit
    memory_limit_bytes: int | None = opt(
        "--memory-limit", default=None, flag_default="75%", parse=memory_limit,
        metavar="SIZE|%|off",
        help="the process's footprint (macOS phys_footprint, Linux RSS) is kept under "
             "this: past 85%% of it MLX's buffer pool, the live states and the RAM tier "
             "give memory back and admission pauses, past 95%% new requests get 429 / 529 "
             "with Retry-After; 8GB or a %% of physical memory (default 75%%; off: no "
             "limit)")
    memory_soft: float = 0.85
    memory_hard: float = 0.95
    # decode rows in one batched forward (more wait at the next chunk boundary)
    max_batch_size: int = 32
    shadow_verify_fraction: float = opt(
        "--shadow-verify", default=0.0, metavar="FRACTION",
        help="recompute this fraction of cache hits in idle time and compare them with "
             "the stored blocks; a mismatch quarantines the chain (default 0: off)")
    # batched prefill: one forward per chunk, at most this many rows and tokens
    prefill_batch_size: int = 8
    prefill_batch_tokens: int = 2048
    # a woken engine gathers a burst: arrivals within this many s of each other (<= 5x)
    batch_window_s: float = 0.01
    # ... and announced requests still being prepared, up to this long (arrivals.py)
    burst_gather_max_s: float = 1.0
    # a request sharing this many uncomputed tokens with a prefill waits for its blocks
    share_prefix_min_tokens: int = 256
    # speculation (engine/speculation/): a tail match of spec_min_match, <= spec_max_rows rows
    speculation: str = opt(
        "--speculation", default="suffix", choices=["suffix", "off"],
        help="speculative decoding drafted from the request's own history, then its "
             "tenant's recent replies; a verify runs only where the gate expects it to "
             "pay (default suffix)")
    spec_max_draft: int = opt("--spec-max-draft", default=8,
                              help="most draft tokens verified per forward (default 8)")
    spec_min_match: int = 3
    spec_max_rows: int = 8
    spec_pool_tokens: int = opt(
        "--spec-pool-tokens", default=65_536,
        help="tokens of finished requests kept as drafts, over all tenants' pools (about "
             "1 KB each; 0: no pool; default %(default)s)")
    spec_pool_prompt_tokens: int = 256  # a pool also holds a prompt's last tokens
    # speculation/cost.py; or (overhead, per_token): rows x width costs o + p*rows*width
    spec_verify_cost: str | tuple[float, float] | None = opt(
        "--spec-verify-cost", default="auto", type=str, metavar="auto|X|C1,C2,...",
        help="what the speculation gate takes a verify forward of k draft tokens to "
             "cost: 'auto' (measured at startup, corrected by the verify forwards timed "
             "while serving), a number X (fixed: 1 + X*k decode steps) or a comma list "
             "(fixed: the cost at k = 1, 2, ... in decode steps; the last slope "
             "continues); default auto")
    spec_max_slowdown: float = opt(
        "--spec-max-slowdown", default=0.0, metavar="F",
        help="how much slower a verify forward may make a row that gains nothing from it "
             "(a request with nothing to copy, batched with rows that copy): beyond the "
             "steps its own drafts saved it, at most F x the tokens it decoded (default "
             "0: never slower; larger: more speculation for the rows that copy)")
    live_states: int = opt(
        "--live-states", default=8, metavar="N",
        help="the caches of the last N finished turns stay as the model's own objects, "
             "so a next turn that extends one restores nothing (counted in --ram-budget, "
             "released before its active blocks; 0: off; default %(default)s)")
    restore_plan: str = opt(  # engine/payload/planner.py
        "--restore-plan", default="auto", choices=("auto", "load", "recompute"),
        help="a cached prefix's SSD / Redis blocks: loaded, or prefilled again from their "
             "tokens when the measured prefill rate beats the tier's measured bandwidth "
             "(auto, the default), or always one (load, recompute: tests, benchmarks)")
    template_render_limit_s: float = opt(
        "--template-render-limit", default=5.0, metavar="SECONDS",
        help="a chat template's render that runs longer is stopped and its request "
             "answered with a 500 (a template that loops); the startup test render too "
             "(default %(default)s)")

    def __post_init__(self) -> None:
        if self.memory_limit_bytes is not None and self.memory_limit_bytes <= 0:
            raise ValueError(f"memory_limit_bytes must be > 0 or None, got "
                             f"{self.memory_limit_bytes}")
        if not 0 < self.memory_soft <= self.memory_hard <= 1:
            raise ValueError("memory watermarks must satisfy 0 < soft <= hard <= 1, got "
                             f"{self.memory_soft} / {self.memory_hard}")
        if not (math.isfinite(self.template_render_limit_s)
                and self.template_render_limit_s > 0):
            raise ValueError(f"template_render_limit_s must be a number > 0, got "
                             f"{self.template_render_limit_s}")
        if self.restore_plan not in ("auto", "load", "recompute"):
            raise ValueError(f"restore_plan must be auto, load or recompute, got "
                             f"{self.restore_plan!r}")
        if self.live_states < 0:
            raise ValueError(f"live_states must be >= 0, got {self.live_states}")
        if self.speculation not in ("suffix", "off"):
            raise ValueError(f"speculation must be 'suffix' or 'off', got {self.speculation!r}")
        if not 1 <= self.spec_max_draft <= 64:
            raise ValueError(f"spec_max_draft must be in [1, 64], got {self.spec_max_draft}")
        if self.spec_max_rows < 1:
            raise ValueError(f"spec_max_rows must be >= 1, got {self.spec_max_rows}")
        if not 1 <= self.spec_min_match <= 16:
            raise ValueError(f"spec_min_match must be in [1, 16], got {self.spec_min_match}")
        if not (math.isfinite(self.spec_max_slowdown) and self.spec_max_slowdown >= 0.0):
            raise ValueError(f"spec_max_slowdown must be a number >= 0, got "
                             f"{self.spec_max_slowdown}")
        if self.spec_pool_tokens < 0:
            raise ValueError(f"spec_pool_tokens must be >= 0, got {self.spec_pool_tokens}")
        if isinstance(self.spec_verify_cost, str):
            verify_cost_steps(self.spec_verify_cost)
        elif self.spec_verify_cost is not None:
            vc = self.spec_verify_cost
            if not isinstance(vc, tuple) or len(vc) != 2 or any(isinstance(v, bool) or not isinstance(v, int | float)
                                   or v < 0 for v in vc) or vc[0] + vc[1] <= 0:
                raise ValueError("spec_verify_cost must be (overhead, per_token), both >= 0 "
                                 f"and not both 0, got {vc!r}")
        if self.spec_pool_prompt_tokens < 0:
            raise ValueError("spec_pool_prompt_tokens must be >= 0, got "
                             f"{self.spec_pool_prompt_tokens}")
        if self.prefill_chunk_tokens < 1:
            raise ValueError("prefill_chunk_tokens must be >= 1")
        if self.snapshot_every_blocks < 1:
            raise ValueError("snapshot_every_blocks must be >= 1")
        if self.message_snapshots < 0:
            raise ValueError(f"message_snapshots must be >= 0, got {self.message_snapshots}")
        if self.max_active_requests < 1:
            raise ValueError(f"max_active_requests must be >= 1, got {self.max_active_requests}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.active_kv_budget_bytes is not None and self.active_kv_budget_bytes <= 0:
            raise ValueError(
                f"active_kv_budget_bytes must be > 0 or None, got {self.active_kv_budget_bytes}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if not 0.0 <= self.shadow_verify_fraction <= 1.0:
            raise ValueError("shadow_verify_fraction must be in [0, 1], got "
                             f"{self.shadow_verify_fraction}")
        if self.prefill_batch_size < 1:
            raise ValueError(f"prefill_batch_size must be >= 1, got {self.prefill_batch_size}")
        if not 0 <= self.batch_window_s <= 1:
            raise ValueError(f"batch_window_s must be in [0, 1], got {self.batch_window_s}")
        if not 0 <= self.burst_gather_max_s <= 10:
            raise ValueError(
                f"burst_gather_max_s must be in [0, 10], got {self.burst_gather_max_s}")
        if self.share_prefix_min_tokens < 0:
            raise ValueError(
                f"share_prefix_min_tokens must be >= 0, got {self.share_prefix_min_tokens}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if not (0.0 < self.repetition_penalty <= 10 and 1 <= self.repetition_context_size <= 4096):
            raise ValueError(f"repetition_penalty must be in (0, 10] and repetition_context_size "
                             f"in [1, 4096], got {self.repetition_penalty}, "
                             f"{self.repetition_context_size}")
        if self.prefill_batch_tokens < 1:
            raise ValueError(
                f"prefill_batch_tokens must be >= 1, got {self.prefill_batch_tokens}")


@dataclass(frozen=True)
class ImageLimits:
    """Images (vision-language models, promptcache[vlm])."""

    allow_local_files: bool = opt(
        "--allow-local-images", default=False, switch=True,
        help="read image parts that name a local file (absolute path / file://)")
    allow_urls: bool = opt(
        "--allow-image-urls", default=False, switch=True,
        help="fetch http(s) image URLs (within --max-image-bytes, 10 s timeout)")
    max_images: int = opt("--max-images", default=16, help="images per request")
    max_bytes: int = opt("--max-image-bytes", default=20 * 1024 * 1024, flag_default="20MB",
                         parse=parse_size, help="encoded size of one image")
    max_pixels: int = opt("--max-image-pixels", default=40_000_000,
                          help="width x height of one image (checked before decoding)")
    fetch_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_bytes <= 0 or self.max_pixels <= 0 or self.max_images < 0:
            raise ValueError("image limits must be positive")
        if not self.fetch_timeout_s > 0:
            raise ValueError(f"fetch_timeout_s must be > 0, got {self.fetch_timeout_s}")


@dataclass(frozen=True)
class EdgeLimits:
    """Connections (the HTTP edge, server/edge.py)."""

    header_timeout_s: float = opt(
        "--header-timeout", default=10.0, metavar="SECONDS",
        help="close a connection that has not sent a whole request head this long after "
             "it opened (or after its next request began); default %(default)s")
    body_timeout_s: float = opt(  # the rate: edge.BODY_MIN_RATE
        "--body-timeout", default=60.0, metavar="SECONDS",
        help="answer 408 and close a request whose body has not arrived in whole this "
             "long after its head, plus one second per 64 KiB received (a large upload on "
             "a slow link still arrives; a body that trickles or stops does not); default "
             "%(default)s")
    max_connections: int = opt(  # edge.fit_to_fd_limit
        "--max-connections", default=1024,
        help="open connections at most; past it idle keep-alive connections are closed "
             "first, then the ones still sending a head (oldest first), and with every one "
             "busy a new one gets 503; lowered to fit the file descriptor limit (default "
             "%(default)s)")
    max_header_bytes: int = 16 * 1024  # a larger request head: 431 (h11's limit)
    # after a refusal mid-request (431, 413) input is dropped this long (no reset)
    linger_s: float = 2.0

    def __post_init__(self) -> None:
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be >= 1024, got {self.max_header_bytes}")
        if self.linger_s < 0:
            raise ValueError(f"linger_s must be >= 0, got {self.linger_s}")
        if not self.header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be > 0, got {self.header_timeout_s}")
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server."""

    host: str = opt("--host", default="127.0.0.1")
    port: int = opt("--port", default=8080)
    api_key: str | None = opt("--api-key", default=None,
                              help="require this key (Bearer or x-api-key)")
    api_keys_file: Path | None = opt(
        "--api-keys-file", default=None,
        help='JSON object {"<key>": "<tenant>"}: keys that select a tenant')
    allowed_origins: tuple[str, ...] = opt(
        "--allowed-origins", default=(), flag_default=None, parse=parse_origins,
        metavar="ORIGINS",
        help="browser origins allowed to call the server (CORS): a comma list "
             "(https://app.example.com,http://localhost:3000) or *; default: none (no CORS "
             "headers)")
    hit_rate_window: int = opt("--hit-rate-window", default=50,
                               help="requests in the rolling hit-rate window")
    hit_rate_alert_threshold: float = opt(
        "--hit-rate-threshold", default=0.8,
        help="warn when the rolling token hit rate drops below this")
    context_window: int | None = opt(
        "--context-window", "--max-model-len", default=None,
        help="the context window to enforce (default: the model's; may only shrink it)")
    max_tokens_overflow: str = opt(
        "--max-tokens-overflow", default="clamp", choices=("clamp", "error"),
        help="prompt + max_tokens past the window, or max_tokens past the limit: clamp "
             "max_tokens to the room left (default), or answer with the APIs' "
             "context-limit error")
    canonicalize_off: tuple[str, ...] = opt(
        "--no-canonicalize", default=(), flag_default=[], append=True, metavar="RULE",
        help="switch a canonical-prompt rule off (repeatable): billing_header, "
             "tool_keys, tool_order, or all")
    prerender: bool = opt("--no-prerender", default=True, switch=True, parse=operator.not_,
                          help="do not pre-render the next turn's prefix in idle time")
    prerender_max_pending: int = opt(
        "--prerender-max-pending", default=4,
        help="next-turn pre-renders queued or running at once (default 4)")
    prerender_max_suffix_tokens: int = 32768
    log_requests_dir: Path | None = opt(
        "--log-requests", default=None, metavar="DIR",
        help="debug: write every /v1 request (secrets left out) as JSON into DIR")
    session_ttl_s: float | None = opt(
        "--session-ttl", default=None, parse=parse_duration,
        help="delete sessions unused for this long from every tier (blocks shared with a "
             "live session stay; 1h, 7d; default: kept)")
    auto_tune: bool = opt(  # autotune.py
        "--auto-tune", default=False, switch=True,
        help="move the RAM budget within --ram-budget-min/max from memory pressure and "
             "the evicted-before-reuse rate (logs every change)")
    ram_budget_min_bytes: int | None = opt(
        "--ram-budget-min", default=None, parse=ram_share,
        help="auto-tune lower bound (512MB, 5%%; default: 100MB or the budget)")
    ram_budget_max_bytes: int | None = opt(
        "--ram-budget-max", default=None, parse=ram_share,
        help="auto-tune upper bound (8GB, 40%%; default: twice the budget)")
    max_body_bytes: int = opt(
        "--max-body-bytes", default=32 * 1024 * 1024, flag_default="32MB", parse=parse_size,
        help="largest /v1 request body; a larger one gets 413 before it is read (default "
             "32MB, as the hosted APIs)")
    # streamed to a temp file in import_dir (or the system's temp folder)
    max_import_bytes: int = opt(
        "--max-import-bytes", default=2 * 1024**3, flag_default="2GB", parse=parse_size,
        help="largest cache pack POST /v1/cache/import accepts: streamed to a temp file "
             "beside the SSD tier, refused with 413 once past it (default 2GB)")
    import_dir: Path | None = None
    keepalive_s: float = 10.0  # between keep-alive events on a silent stream
    responses_store_size: int = 256  # for previous_response_id (bounded, in RAM)
    images: ImageLimits = field(default_factory=ImageLimits)
    edge: EdgeLimits = field(default_factory=EdgeLimits)

    def __post_init__(self) -> None:
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.api_keys_file is not None and not self.api_keys_file.is_file():
            raise ValueError(f"api_keys_file {self.api_keys_file} does not exist")
        if self.hit_rate_window < 1:
            raise ValueError(f"hit_rate_window must be >= 1, got {self.hit_rate_window}")
        if not 0.0 <= self.hit_rate_alert_threshold <= 1.0:
            raise ValueError("hit_rate_alert_threshold must be in [0, 1], got "
                             f"{self.hit_rate_alert_threshold}")
        if (self.ram_budget_min_bytes is not None or self.ram_budget_max_bytes is not None) \
                and not self.auto_tune:
            raise ValueError("ram_budget_min_bytes / ram_budget_max_bytes need auto_tune")
        for origin in self.allowed_origins:
            if origin != "*" and "://" not in origin:
                raise ValueError(f"allowed_origins: {origin!r} is not '*' or an origin "
                                 "(scheme://host[:port])")
        if "*" in self.allowed_origins and len(self.allowed_origins) > 1:
            raise ValueError("allowed_origins: '*' allows every origin, list no others")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.max_import_bytes < 1:
            raise ValueError(f"max_import_bytes must be >= 1, got {self.max_import_bytes}")
        if self.context_window is not None and self.context_window < 2:
            raise ValueError(f"context_window must be >= 2, got {self.context_window}")
        if self.max_tokens_overflow not in ("clamp", "error"):
            raise ValueError("max_tokens_overflow must be 'clamp' or 'error', "
                             f"got {self.max_tokens_overflow!r}")
        if not self.keepalive_s > 0:
            raise ValueError(f"keepalive_s must be > 0, got {self.keepalive_s}")
        if self.prerender_max_pending < 1:
            raise ValueError(f"prerender_max_pending must be >= 1, got {self.prerender_max_pending}")
        if self.prerender_max_suffix_tokens < 1:
            raise ValueError("prerender_max_suffix_tokens must be >= 1, got "
                             f"{self.prerender_max_suffix_tokens}")
        if self.session_ttl_s is not None and not self.session_ttl_s > 0:
            raise ValueError(f"session_ttl_s must be > 0, got {self.session_ttl_s}")
        lo, hi = self.ram_budget_min_bytes, self.ram_budget_max_bytes
        if (lo is not None and lo < 0) or (hi is not None and hi < 0) or (
                lo is not None and hi is not None and lo > hi):
            raise ValueError(f"the auto-tune RAM bounds must satisfy 0 <= min <= max, "
                             f"got [{lo}, {hi}]")
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size must be >= 0, got {self.responses_store_size}")


def verify_cost_steps(setting: str | None) -> tuple[float, ...] | None:
    """``spec_verify_cost`` as text -> the fixed verify costs in decode steps at
    k = 1, 2, ... (one number ``x``: ``(1 + x,)``, the per-position slope ``x``), or
    None for ``auto``; ValueError when it is neither."""
    if setting is None or setting.strip().lower() == "auto":
        return None
    parts = [p.strip() for p in setting.split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError("spec_verify_cost must be 'auto', a number (the cost per extra "
                         "position in decode steps) or a comma list of costs at k = 1, 2, "
                         f"... in decode steps, got {setting!r}") from None
    if len(values) == 1:
        x = values[0]
        if not math.isfinite(x) or x < 0:
            raise ValueError(f"spec_verify_cost: the cost per extra position must be a "
                             f"finite number >= 0, got {setting!r}")
        return (1.0 + x,)
    if any(not math.isfinite(v) or v < 1.0 for v in values):
        raise ValueError("spec_verify_cost: each verify cost must be a finite number of "
                         f"decode steps >= 1, got {setting!r}")
    return tuple(values)
