"""Storage configuration: sizes and the cache and its tiers (RAM, SSD, Redis); ValueError if invalid."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

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


def default_cache_dir() -> Path:
    base = os.environ.get("PROMPTCACHE_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "promptcache"
    )
    return Path(base)


@dataclass(frozen=True)
class CacheConfig:
    """The block cache and its RAM tier."""

    block_size: int = 64
    # None = 20% of available RAM (psutil), at least ``min_ram_budget_bytes``.
    ram_budget_bytes: int | None = None
    min_ram_budget_bytes: int = 100 * MB
    ttl_seconds: float | None = None
    # bounded memory of recent misses/evictions used to explain misses
    explain_history: int = 4096
    enabled: bool = True
    # a clean shutdown writes every RAM block the lower tiers lack within this time
    persist_timeout_s: float | None = 120.0
    # share of the RAM budget that protected blocks (cache_control breakpoints,
    # prompt_cache_key chains) may take; the oldest protections give way beyond it
    protect_share: float = 0.25
    # a session's latest chain is evicted only after idle chains while the session
    # sent a request in the last this many seconds (None: no session levels)
    active_session_s: float | None = 600.0
    # KV quantization of stored blocks (every tier): None = full precision, or 8 / 4 bits
    # per value with one scale + bias per ``kv_group_size`` values; blocks starting
    # before ``kv_quant_min_tokens`` stay at full precision. Part of the namespace.
    kv_bits: int | None = None
    kv_group_size: int = 64
    kv_quant_min_tokens: int = 256
    # MLX arrays the RAM tier may hold (one buffer per block; None: no cap). Metal caps a
    # process's buffers (~499,000) whatever their bytes: the default leaves room for the
    # model, the running requests and the live states
    max_arrays: int | None = 400_000

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
        import psutil  # type: ignore[import-untyped]

        return max(self.min_ram_budget_bytes, int(psutil.virtual_memory().available * 0.20))


@dataclass(frozen=True)
class SSDConfig:
    """The persistent SSD tier."""

    path: Path = field(default_factory=lambda: default_cache_dir() / "blocks")
    budget_bytes: int = 10 * GB
    ttl_seconds: float | None = None
    queue_size: int = 64
    policy: str = "write_back"  # or "write_through"
    daily_write_budget_bytes: int | None = None
    admission_min_hits: int = 0  # persist only blocks hit at least this often
    admission_min_tokens: int = 0  # persist only sequences of at least this many tokens
    fsync: bool = True
    # free space the tier leaves on its disk: the budget in use is capped by the bytes
    # stored + the disk's free bytes - this reserve (None: 5% of the disk, at most 1 GB)
    disk_reserve_bytes: int | None = None
    # > 0: new blocks are appended to segment files of about this size (tiers/ssd_segments);
    # 0: one file per block. Folders of either layout are read by both.
    segment_bytes: int = 0

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
    """The shared Redis / Valkey tier (standalone or Cluster). Times in seconds."""

    url: str
    cluster: bool = False  # also implied by a redis+cluster:// url
    prefix: str = "promptcache"  # every key starts with "<prefix>:"
    ttl_seconds: float = 24 * 3600.0  # on every key, counted from the last write
    timeout_s: float = 0.05  # per socket operation (read / write)
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
