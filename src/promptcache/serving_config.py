"""Serving configuration: the engine's generation settings, image limits and the HTTP server."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class EngineConfig:
    """Generation: prefill chunking and state snapshots."""

    # a multiple of the block size; each completed chunk is stored (mid-prefill save)
    prefill_chunk_tokens: int = 256
    # non-truncatable states (SSM/hybrid): snapshot every k blocks during prefill
    snapshot_every_blocks: int = 4
    # ... and at message starts (where conversations branch: a retry or an edit of the
    # last user message, a subagent): at most this many per prompt, the last ones
    # (each costs a prefill stop and one state's bytes; 0 = none)
    message_snapshots: int = 16
    max_tokens_limit: int = 32768
    default_max_tokens: int = 512
    # admission control: requests admitted at once (prefilling + decoding), requests
    # waiting beyond that (more are refused: 429 / 529 with Retry-After), and the bytes
    # of KV that admitted requests may hold (restored + growing, batch padding
    # included; None = no byte limit). The RAM tier's budget is separate: the server
    # may use ram_budget + active_kv_budget for KV.
    max_active_requests: int = 16
    max_queued_requests: int = 64
    active_kv_budget_bytes: int | None = None
    # decode rows in one batched forward (more wait at the next chunk boundary)
    max_batch_size: int = 32
    # shadow verification (engine/shadow.py): the fraction of cache hits recomputed in
    # idle time and compared with the stored blocks (0 = off)
    shadow_verify_fraction: float = 0.0
    # batched prefill: requests prefilling at the same step share one forward per
    # chunk; at most this many rows and this many tokens per step (each row feeds at
    # most one chunk per step)
    prefill_batch_size: int = 8
    prefill_batch_tokens: int = 2048
    # an idle engine woken by a request waits while more arrive within this many
    # seconds of each other (at most 5x in all), so a burst prefills as one batch
    batch_window_s: float = 0.01
    # ... and while requests the server announced are still being prepared (one
    # preparation at a time), up to this many seconds from the wake-up (arrivals.py)
    burst_gather_max_s: float = 1.0
    # a new request whose prompt shares at least this many tokens (whole blocks) not yet
    # computed with a request being prefilled waits until that one has stored them,
    # then restores them from the cache (0 = never wait: requests sent together each
    # compute their shared prefix, e.g. parallel subagents' system prompt + tools)
    share_prefix_min_tokens: int = 256
    # speculative decoding drafted from the request's own history (engine/drafts.py,
    # engine/speculate.py): "suffix" or "off"; at most this many draft tokens per verify
    # forward, from a tail match of at least spec_min_match tokens
    speculation: str = "suffix"
    spec_max_draft: int = 8
    spec_min_match: int = 3
    # speculate while at most this many rows decode together (1: one stream only)
    spec_max_rows: int = 8
    # the per-tenant draft pool: a finished request's output (and the last
    # spec_pool_prompt_tokens of its prompt) drafts for later requests of its tenant;
    # at most spec_pool_tokens tokens over all tenants (0: no pool). About 1 KB of Python
    # objects per pooled token (the n-gram index): the default holds ~64 MB
    spec_pool_tokens: int = 65_536
    spec_pool_prompt_tokens: int = 256
    # what a verify forward of k draft tokens costs, for speculation's gate
    # (engine/spec_cost.py): "auto" (or None): measured on the model at startup, then
    # corrected by the verify forwards and decode steps timed while serving; a number
    # ("0.3"): fixed, 1 + 0.3 k decode steps; a comma list ("1.4,1.6,2.1"): fixed, the
    # cost at k = 1, 2, 3 in decode steps (the last slope continues); a tuple
    # (overhead, per_token): fixed, a forward of rows x width positions costs
    # overhead + per_token * rows * width
    spec_verify_cost: str | tuple[float, float] | None = "auto"
    # a verify may cost a row no more decode steps than its drafts saved it so far plus
    # this fraction of the tokens it decoded (engine/spec_cost.py Credits): a row with
    # nothing to copy decodes at most this much slower next to rows that copy
    spec_max_slowdown: float = 0.0
    # live session state (engine/live.py): the caches of at most this many finished turns
    # stay as the model's own cache objects (counted in the RAM tier's budget, released
    # before its active blocks), so a next turn that extends one restores nothing; 0: off
    live_states: int = 8
    # restore or recompute a matched prefix's lower-tier blocks (engine/planner.py):
    # "auto" (the measured rates decide), "load" or "recompute" (forced)
    restore_plan: str = "auto"
    # the memory governor (engine/governor.py): the process's footprint is kept under
    # this many bytes (None: no governor); past soft x it, the holders release (MLX's
    # buffer pool, live states, the RAM tier) and admission pauses; past hard x it, new
    # requests are refused with 429 / 529
    memory_limit_bytes: int | None = None
    memory_soft: float = 0.85
    memory_hard: float = 0.95
    # a chat template's render past this many seconds is stopped (engine/templates.py:
    # a template that loops answers a 500 instead of holding the preparation thread)
    template_render_limit_s: float = 5.0

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
        if self.prefill_batch_tokens < 1:
            raise ValueError(
                f"prefill_batch_tokens must be >= 1, got {self.prefill_batch_tokens}")


@dataclass(frozen=True)
class ImageLimits:
    """Image inputs of vision-language models (``server/prompts/images.py``)."""

    max_bytes: int = 20 * 1024 * 1024  # encoded size of one image
    max_pixels: int = 40_000_000  # width x height, checked from the header before decoding
    max_images: int = 16  # per request (the whole conversation's images)
    allow_local_files: bool = False  # absolute paths / file:// URLs
    allow_urls: bool = False  # fetch http(s) URLs
    fetch_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_bytes <= 0 or self.max_pixels <= 0 or self.max_images < 0:
            raise ValueError("image limits must be positive")
        if not self.fetch_timeout_s > 0:
            raise ValueError(f"fetch_timeout_s must be > 0, got {self.fetch_timeout_s}")


@dataclass(frozen=True)
class EdgeLimits:
    """The HTTP edge (server/edge.py): what one connection may hold before it has sent
    a request, and how many connections the server keeps open."""

    # a connection that has not sent a whole request head this many seconds after it
    # opened (or after the first byte of its next request) is closed
    header_timeout_s: float = 10.0
    # a request whose body has not arrived in whole this many seconds after its head
    # (plus a second per 64 KiB received: edge.BODY_MIN_RATE) is answered 408 and closed
    body_timeout_s: float = 60.0
    # open connections at most; past it the idle keep-alive ones are closed first, then
    # the ones still sending a head (oldest first); with every one busy a new one is
    # answered 503 and closed. Sized to the fd limit at startup (edge.fit_to_fd_limit)
    max_connections: int = 1024
    # a request head larger than this is answered 431 (h11's default limit)
    max_header_bytes: int = 16 * 1024
    # a refusal sent while the client still sends (431, a 413 mid-body) half-closes the
    # connection and drops what still arrives for up to this many seconds, so the
    # client reads the answer instead of a connection reset
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
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    # optional JSON file mapping API keys to tenants
    api_keys_file: Path | None = None
    # browser origins allowed to call the server (CORS; "*": any); (): no CORS headers
    allowed_origins: tuple[str, ...] = ()
    hit_rate_window: int = 50
    hit_rate_alert_threshold: float = 0.8
    # the context window the server enforces (None: the model's own; may only shrink it)
    context_window: int | None = None
    # prompt + max_tokens past the window (or max_tokens past max_tokens_limit): "clamp"
    # max_tokens to the room left (and the limit), or "error" (the APIs' own
    # context-limit wordings, which clients act on)
    max_tokens_overflow: str = "clamp"
    # seconds between keep-alive events on a stream that has nothing else to send
    keepalive_s: float = 10.0
    # debug: write every /v1 request (secrets scrubbed) as a JSON file into this folder
    log_requests_dir: Path | None = None
    # responses kept for previous_response_id / GET /v1/responses/{id} (bounded, in RAM)
    responses_store_size: int = 256
    # canonical-prompt rules switched off (server/prompts/canon.py; "all" = every rule)
    canonicalize_off: tuple[str, ...] = ()
    # next-turn pre-render (server/prompts/prerender.py): on, at most this many at once, and
    # only suffixes up to this many tokens
    prerender: bool = True
    prerender_max_pending: int = 4
    prerender_max_suffix_tokens: int = 32768
    images: ImageLimits = field(default_factory=ImageLimits)
    # sessions unused for this long are deleted from every tier (None: kept)
    session_ttl_s: float | None = None
    # --auto-tune: move the RAM budget within [min, max] (autotune.py)
    auto_tune: bool = False
    ram_budget_min_bytes: int | None = None
    ram_budget_max_bytes: int | None = None
    # bodies of /v1/* requests larger than this are refused with 413 before any work
    max_body_bytes: int = 32 * 1024 * 1024
    # POST /v1/cache/import: the largest pack accepted (streamed to a temp file in
    # import_dir, or the system's temp folder; refused with 413 once past it)
    max_import_bytes: int = 2 * 1024**3
    import_dir: Path | None = None
    # the HTTP edge: head timeout, connection cap (server/edge.py)
    edge: EdgeLimits = field(default_factory=EdgeLimits)

    def __post_init__(self) -> None:
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
