"""Storage configuration: sizes and the cache and its tiers (RAM, SSD, Redis); ValueError
if invalid. Fields declared with ``opt`` are `promptcache serve` flags (options.py)."""

from __future__ import annotations

import operator
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .options import opt

MB = 1024**2
GB = 1024**3

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$", re.IGNORECASE)
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1024, "m": MB, "g": GB, "t": 1024**4}


def parse_duration(text: str) -> float:
    """``7d``, ``12h``, ``30m``, ``45s``, ``2w`` -> seconds. ValueError otherwise."""
    m = _DURATION.match(text or "")
    if not m:
        raise ValueError(f"invalid duration {text!r} (use e.g. 7d, 12h, 30m)")
    return float(m.group(1)) * _UNIT_S[m.group(2).lower()]


def parse_size(text: str | int, *, total: int | None = None) -> int:
    """Parse ``512MB``, ``4GB``, ``1.5G``, ``1048576`` or ``20%`` (of ``total``) into bytes."""
    if isinstance(text, bool):
        raise ValueError(f"invalid size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    s = str(text).strip()
    if s.endswith("%"):
        if total is None:
            raise ValueError(f"a percentage size ({s}) needs a total to be relative to")
        try:
            pct = float(s[:-1])
        except ValueError:
            raise ValueError(f"invalid size: {text!r}") from None
        if not 0 < pct <= 100:
            raise ValueError(f"percentage must be in (0, 100], got {s}")
        return int(total * pct / 100)
    m = _SIZE_RE.match(s)
    if not m:
        raise ValueError(f"invalid size: {text!r} (use e.g. 512MB, 4GB, 20%)")
    unit = (m.group(2) or "").lower().rstrip("b").rstrip("i")
    return int(float(m.group(1)) * _UNITS[unit])


def ram_share(text: str) -> int:
    """A size, or a % of the RAM available now."""
    import psutil  # type: ignore[import-untyped]

    return parse_size(text, total=psutil.virtual_memory().available)


MIN_KV_BUDGET = 256 * 1024**2


def kv_budget(text: str) -> int:
    """``--kv-budget``: a size or a % of the RAM available, at least ``MIN_KV_BUDGET``."""
    return max(MIN_KV_BUDGET, ram_share(text))


def memory_limit(value: str) -> int | None:
    """``--memory-limit``: bytes (a size, or a % of physical memory), None for ``off``."""
    import psutil

    if value.strip().lower() == "off":
        return None
    limit = parse_size(value, total=psutil.virtual_memory().total)
    if limit <= 0:
        raise ValueError(f"must be > 0 (or off), got {value!r}")
    return limit


def parse_origins(value: str) -> tuple[str, ...]:
    """``--allowed-origins``: a comma list of origins, or ``*`` (any origin)."""
    origins = tuple(o.strip().rstrip("/") for o in value.split(","))
    if not all(origins):
        raise ValueError(f"an empty origin in {value!r}")
    return origins


def default_cache_dir() -> Path:
    base = os.environ.get("PROMPTCACHE_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "promptcache"
    )
    return Path(base)


@dataclass(frozen=True)
class CacheConfig:
    """The block cache and its RAM tier."""

    # None = 20% of available RAM (psutil), at least ``min_ram_budget_bytes``.
    ram_budget_bytes: int | None = opt(
        "--ram-budget", default=None, parse=ram_share,
        help="RAM tier budget: 512MB, 4GB or 20%% of available RAM (default 20%%)")
    # MLX arrays the RAM tier may hold (None: no cap); the default leaves room for the
    # model, the running requests and the live states
    max_arrays: int | None = opt(
        "--max-arrays", default=400_000, metavar="N",
        help="MLX arrays the RAM tier may hold (one per block): Metal caps a process's "
             "buffers at ~499,000 whatever their bytes (default %(default)s)")
    block_size: int = opt("--block-size", default=64, help="tokens per cache block")
    persist_timeout_s: float | None = opt(
        "--shutdown-persist-timeout", default=120.0,
        help="seconds a clean shutdown may spend writing the RAM blocks the SSD lacks "
             "(default %(default)s; what is left is logged by name)")
    # KV quantization of stored blocks (every tier), part of the namespace: one scale +
    # bias per ``kv_group_size`` values
    kv_bits: int | None = opt(
        "--kv-bits", default=None, choices=(8, 4),
        help="store cached blocks quantized to 8 or 4 bits (every tier; default: full "
             "precision); dequantized on restore")
    kv_group_size: int = opt("--kv-group-size", default=64, choices=(32, 64, 128),
                             help="values per quantization scale/bias (default 64)")
    kv_quant_min_tokens: int = opt(
        "--kv-quant-min-tokens", default=256,
        help="blocks starting before this token stay full precision (default 256)")
    ttl_seconds: float | None = opt(
        "--ttl", default=None, parse=parse_duration,
        help="drop cached blocks unused for this long, in RAM and on the SSD (30m, 12h, "
             "7d; default: kept until evicted)")
    enabled: bool = opt("--no-cache", default=True, switch=True, parse=operator.not_,
                        help="disable the prompt cache")
    # (prompt_cache_key chains are protected too; the oldest protections give way)
    protect_share: float = opt(
        "--protect-share", default=0.25,
        help="share of the RAM budget that cache_control breakpoints and prompt_cache_key "
             "chains may keep from eviction (default 0.25)")
    active_session_s: float | None = opt(
        "--session-active-minutes", default=600.0, flag_default=10.0, type=float,
        parse=lambda minutes: minutes * 60.0 or None,
        help="a session's latest chain is evicted only after idle chains while it sent a "
             "request in the last N minutes (default 10; 0: off)")
    min_ram_budget_bytes: int = 100 * MB
    # bounded memory of recent misses/evictions used to explain misses
    explain_history: int = 4096

    def __post_init__(self) -> None:
        if self.max_arrays is not None and (isinstance(self.max_arrays, bool)
                                            or self.max_arrays < 1):
            raise ValueError(f"max_arrays must be >= 1 or None, got {self.max_arrays!r}")
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 4096:
            raise ValueError(f"block_size must be an integer in [1, 4096], got {self.block_size!r}")
        if self.kv_bits is not None and (isinstance(self.kv_bits, bool) or self.kv_bits not in (4, 8)):
            raise ValueError(f"kv_bits must be 4, 8 or None, got {self.kv_bits!r}")
        if isinstance(self.kv_group_size, bool) or self.kv_group_size not in (32, 64, 128):
            raise ValueError(f"kv_group_size must be 32, 64 or 128, got {self.kv_group_size!r}")
        if isinstance(self.kv_quant_min_tokens, bool) or not isinstance(self.kv_quant_min_tokens, int) \
                or self.kv_quant_min_tokens < 0:
            raise ValueError(f"kv_quant_min_tokens must be an integer >= 0, got {self.kv_quant_min_tokens!r}")
        if self.ram_budget_bytes is not None and self.ram_budget_bytes < 0:
            raise ValueError(f"ram_budget_bytes must be >= 0, got {self.ram_budget_bytes}")
        if self.ttl_seconds is not None and self.ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be > 0, got {self.ttl_seconds}")
        if self.persist_timeout_s is not None and self.persist_timeout_s < 0:
            raise ValueError(f"persist_timeout_s must be >= 0, got {self.persist_timeout_s}")
        if not 0.0 <= self.protect_share <= 1.0:
            raise ValueError(f"protect_share must be in [0, 1], got {self.protect_share!r}")
        if self.active_session_s is not None and self.active_session_s <= 0:
            raise ValueError(f"active_session_s must be > 0 or None, got {self.active_session_s!r}")

    def resolved_ram_budget(self) -> int:
        if self.ram_budget_bytes is not None:
            return self.ram_budget_bytes
        import psutil

        return max(self.min_ram_budget_bytes, int(psutil.virtual_memory().available * 0.20))


def megabytes(mb: int) -> int:
    if mb < 0:
        raise ValueError(f"must be >= 0 MB, got {mb}")
    return mb << 20


@dataclass(frozen=True)
class SSDConfig:
    """The persistent SSD tier."""

    path: Path = opt("--cache-dir", factory=lambda: default_cache_dir() / "blocks",
                     help="SSD tier folder (default: <promptcache home>/blocks)")
    # (a % is of the free space of ``path``'s disk: serve_config.build_configs)
    budget_bytes: int = opt("--ssd-budget", default=10 * GB, flag_default="10GB",
                            parse=parse_size,
                            help="SSD tier budget: 10GB, or a %% of the free disk space")
    policy: str = opt(
        "--ssd-policy", default="write_back", flag_default="write_through",
        choices=("write_through", "write_back"),
        help="write_through: persist blocks as they are stored (survives kill -9); "
             "write_back: only evicted blocks, the rest at a clean shutdown")
    queue_size: int = opt("--ssd-queue-size", default=64,
                          help="blocks waiting for the SSD writer; more wait in RAM, never "
                               "dropped (default %(default)s)")
    ttl_seconds: float | None = None
    daily_write_budget_bytes: int | None = None
    admission_min_hits: int = 0  # persist only blocks hit at least this often
    admission_min_tokens: int = 0  # persist only sequences of at least this many tokens
    fsync: bool = True
    # free space the tier leaves on its disk: the budget in use is capped by the bytes
    # stored + the disk's free bytes - this reserve (None: 5% of the disk, at most 1 GB)
    disk_reserve_bytes: int | None = None
    segment_bytes: int = opt(  # folders of either layout are read by both
        "--ssd-segment-mb", default=0, flag_default=256, parse=lambda mb: megabytes(int(mb)),
        type=int, metavar="MB",
        help="append new SSD blocks to segment files of about this many MB, one write and "
             "fsync per batch, runs read in parallel (default %(default)s; 0: one file per block)")

    def __post_init__(self) -> None:
        if self.segment_bytes < 0:
            raise ValueError(f"segment_bytes must be >= 0, got {self.segment_bytes}")
        if self.policy not in ("write_back", "write_through"):
            raise ValueError(f"policy must be 'write_back' or 'write_through', got {self.policy!r}")
        if self.queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {self.queue_size}")
        if self.budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {self.budget_bytes}")
        if self.ttl_seconds is not None and self.ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be > 0, got {self.ttl_seconds}")
        if self.disk_reserve_bytes is not None and self.disk_reserve_bytes < 0:
            raise ValueError(f"disk_reserve_bytes must be >= 0, got {self.disk_reserve_bytes}")


_REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")
_SAFE_PREFIX = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class RedisConfig:
    """The shared Redis / Valkey tier (standalone or Cluster)."""

    url: str = opt("--redis-url", help="shared tier on Redis / Valkey: redis://, rediss://, "
                   "unix:// or redis+cluster://HOST:PORT (several servers reuse each other's "
                   "blocks)")
    cluster: bool = opt("--redis-cluster", default=False, switch=True,  # or a +cluster url
                        help="the --redis-url names a Redis Cluster node")
    # on every key, counted from the last write
    ttl_seconds: float = opt("--redis-ttl", default=24 * 3600.0, flag_default="24h",
                             parse=parse_duration,
                             help="TTL of every Redis key (24h, 7d, 3600)")
    # per socket operation (read / write)
    timeout_s: float = opt("--redis-timeout-ms", default=0.05, flag_default=50.0, type=float,
                           parse=lambda ms: ms / 1000.0,
                           help="per-operation timeout on the request path (default 50)")
    # every key starts with "<prefix>:"
    prefix: str = opt("--redis-prefix", default="promptcache", help="key prefix")
    connect_timeout_s: float = 0.1
    queue_size: int = 256  # blocks waiting for the writer thread; more wait in the cache's RAM
    policy: str = "write_through"  # or "write_back" (only blocks evicted from RAM)
    max_value_bytes: int = 64 * MB
    batch_bytes: int = 32 * MB  # payload bytes per pipelined write / read batch
    breaker_failures: int = 3  # consecutive failures that open the circuit
    breaker_backoff_s: float = 1.0  # first open period; doubles up to the max
    breaker_max_backoff_s: float = 10.0  # bounds the recovery after Redis is back
    probe_interval_s: float = 0.25  # how often the prober checks whether a probe is due

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(_REDIS_SCHEMES):
            raise ValueError(
                f"redis url must start with one of {', '.join(_REDIS_SCHEMES)}, got {self.url!r}"
            )
        if not _SAFE_PREFIX.match(self.prefix):
            raise ValueError(f"redis key prefix must be 1-64 of [A-Za-z0-9._-], got {self.prefix!r}")
        if self.policy not in ("write_back", "write_through"):
            raise ValueError(f"policy must be 'write_back' or 'write_through', got {self.policy!r}")
        for name in ("ttl_seconds", "timeout_s", "connect_timeout_s", "breaker_backoff_s",
                     "breaker_max_backoff_s", "probe_interval_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                raise ValueError(f"{name} must be > 0, got {v!r}")
        if self.breaker_max_backoff_s < self.breaker_backoff_s:
            raise ValueError("breaker_max_backoff_s must be >= breaker_backoff_s")
        for name in ("queue_size", "max_value_bytes", "batch_bytes", "breaker_failures"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")

    @property
    def is_cluster(self) -> bool:
        return self.cluster or "+cluster://" in self.url
