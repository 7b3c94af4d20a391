"""Automated diagnosis: the dominant miss cause over a window and a concrete remedy. A ghost list of
evicted blocks gives the budget that would have hit (LRU stack distance)."""

from __future__ import annotations

import statistics
import threading
from collections import Counter, deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .hashing import BlockHash, hash_block
from .lru import BoundedLRU
from .meta import BlockMeta, ExtraKeySpan, Namespace, extra_keys_for

MIB = 1024**2


def round_up(n: int) -> int:
    """Round a byte figure up to about 1/16 of its power of two (150 KB, 6.5 GB)."""
    unit = 1 << max(0, n.bit_length() - 5)
    return -(-n // unit) * unit


@dataclass(frozen=True)
class LookupSample:
    prompt_tokens: int
    hit_tokens: int
    cause: str | None
    position: int | None
    needed_budget: int | None  # evicted misses: the RAM budget that would have kept the run
    recoverable_tokens: int  # ... and the tokens that run holds


class EvictionAdvisor:
    """A ``PromptCache`` observer (under the cache lock; ``window`` from any thread)."""

    def __init__(self, cache: Any, *, ghost_entries: int = 65536, window: int = 200) -> None:
        if ghost_entries < 1 or window < 1:
            raise ValueError("ghost_entries and window must be >= 1")
        self.cache = cache
        self._ghost: BoundedLRU[BlockHash, tuple[int, int]] = BoundedLRU(ghost_entries)
        self._evicted_bytes = 0
        self._samples: deque[LookupSample] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.num_lookups = 0

    def evicted(self, meta: BlockMeta) -> None:
        with self._lock:
            self._evicted_bytes += meta.nbytes
            self._ghost.put(meta.block_hash, (self._evicted_bytes, meta.nbytes))

    def acquired(self, req: Any, ns: Namespace, spans: Sequence[ExtraKeySpan],
                 hit_tokens: int, miss: Any) -> None:
        cause = getattr(miss, "cause", None)
        position = getattr(miss, "position", None)
        needed, recoverable = None, 0
        if cause == "evicted" and position is not None:
            needed, recoverable = self._needed_budget(req.arr, ns, spans, int(position))
        with self._lock:
            self.num_lookups += 1
            self._samples.append(LookupSample(int(req.n), int(hit_tokens), cause, position,
                                              needed, recoverable))

    def _needed_budget(self, tokens: Any, ns: Namespace, spans: Sequence[ExtraKeySpan],
                       position: int) -> tuple[int | None, int]:
        bs = ns.block_size
        parent = ns.root
        first = position // bs
        worst: int | None = None
        run_bytes = 0
        recoverable = 0
        with self._lock:
            now = self._evicted_bytes
            for b in range(len(tokens) // bs):
                start = b * bs
                extra = extra_keys_for(spans, start, start + bs) if spans else ()
                parent = hash_block(parent, tokens[start:start + bs], extra)
                if b < first:
                    continue
                g = self._ghost.peek(parent)
                if g is None:
                    break
                pushed = now - g[0]
                worst = pushed if worst is None else max(worst, pushed)
                run_bytes += g[1]
                recoverable += bs
        if worst is None:
            return None, 0
        return int(self.cache.pool.budget_bytes) + worst + run_bytes, recoverable

    def window(self) -> list[LookupSample]:
        with self._lock:
            return list(self._samples)

    def recommended_budget(self) -> int | None:
        """The RAM budget that would have kept every run evicted before reuse (None: none)."""
        needed = [s.needed_budget for s in self.window() if s.needed_budget is not None]
        return round_up(max(needed)) if needed else None

    def eviction_miss_rate(self) -> float:
        """Tokens lost to evicted-before-reuse blocks / prompt tokens, over the window."""
        w = self.window()
        prompt = sum(s.prompt_tokens for s in w)
        return sum(s.recoverable_tokens for s in w) / prompt if prompt else 0.0


def _size(n: int) -> str:
    for unit, div in (("GB", 1024**3), ("MB", MIB), ("KB", 1024)):
        if n >= div:
            return f"{n / div:.1f} {unit}".replace(".0 ", " ")
    return f"{n} B"


_TEXT = {
    "expired": "were blocks that expired before reuse ({ttl}): a longer --ttl would have "
               "kept them",
    "promotion_failed": "could not be promoted from a lower tier into RAM: the RAM budget "
                        "({budget}) is too small for the restored chains; raise --ram-budget",
    "not_restorable": "stopped where no state snapshot was stored (SSM / hybrid models): "
                      "store snapshots more often (EngineConfig.snapshot_every_blocks) "
                      "and at more message starts (EngineConfig.message_snapshots)",
    "other_namespace": "belong to another model, block size or tenant: nothing to reuse",
}


_CHANGED = {
    "tools_changed": "the tools changed",
    "system_changed": "the system prompt changed",
    "messages_changed": "the conversation's history changed",
    "diverged": "the prompt diverged from a cached one",
}


def diagnose(samples: Sequence[LookupSample], stats: Mapping[str, Any] | None = None,
             *, recommended_budget: int | None = None,
             missed: Mapping[str, int] | None = None,
             canonical_off: Collection[str] = ()) -> dict[str, Any]:
    """The dominant miss cause (by missed tokens, cold excluded), its share, a remedy and tier
    findings; ``canonical_off``: the only rules advised back on."""
    stats = stats or {}
    if missed is None:
        counted: Counter[str] = Counter()
        for s in samples:
            if s.cause is not None and s.cause != "cold":
                counted[s.cause] += s.prompt_tokens - s.hit_tokens
    else:
        counted = Counter({k: v for k, v in missed.items() if v > 0})
    total = sum(counted.values())
    out: dict[str, Any] = {"window_lookups": len(samples), "missed_tokens_by_cause":
                           dict(counted), "dominant_cause": None, "share": None,
                           "remedy": None, "summary": None, "findings": _findings(stats)}
    if total:
        cause, n = counted.most_common(1)[0]
        share = n / total
        out["dominant_cause"], out["share"] = cause, share
        pct = f"{share * 100:.0f}% of missed tokens"
        budget = int(stats.get("ram_budget_bytes") or 0)
        if cause == "evicted":
            need = recommended_budget
            if need is None:
                needed = [s.needed_budget for s in samples if s.needed_budget is not None]
                need = round_up(max(needed)) if needed else None
            if need is not None:
                out["remedy"] = {"ram_budget_bytes": need}
                out["summary"] = (f"{pct} were blocks evicted before reuse: a RAM budget of "
                                  f"{_size(need)} would have kept them (now {_size(budget)})")
            else:
                out["summary"] = f"{pct} were blocks evicted before reuse: raise --ram-budget"
        elif cause in _CHANGED:
            pos = [s.position for s in samples if s.cause == "diverged" and s.position is not None]
            at = f" (median at token {int(statistics.median(pos))})" \
                if pos and cause == "diverged" else ""
            off = sorted(canonical_off)
            head = f"{pct} were lost where {_CHANGED[cause]}{at}"
            if off:
                out["remedy"] = {"canonical_rules_on": off}
                out["summary"] = (f"{head}: the canonical-prompt rules {', '.join(off)} are "
                                  "off (--no-canonicalize): with them on, volatile metadata, "
                                  "reordered tools and template drift no longer change the "
                                  "prompt")
            else:
                out["summary"] = (f"{head}, with every canonical-prompt rule on: the client "
                                  "sent a different prompt; each request's miss= in the log "
                                  "(or Anthropic diagnostics) says where")
        elif cause == "cold":
            out["summary"] = (f"{pct} were gone from the cache without a trace (deleted, "
                              "or evicted longer ago than the cache remembers)")
        elif cause.startswith("not_stored"):
            why = cause.partition(":")[2].strip() or "unknown"
            out["remedy"] = {"store_error_cause": why}
            if why == "budget":
                out["summary"] = (f"{pct} were never stored: the RAM budget ({_size(budget)}) "
                                  "had no room for them (blocks in use filled it): raise "
                                  "--ram-budget")
            else:
                out["summary"] = (f"{pct} were never stored: saving their blocks failed "
                                  f"(cause: {why}); see the engine's store_errors_by_cause "
                                  "and the server log")
        else:
            ttl = stats.get("ttl_seconds")
            text = _TEXT.get(cause, "were misses of this kind").format(
                ttl=f"--ttl {ttl:.0f} s" if ttl else "--ttl", budget=_size(budget))
            out["summary"] = f"{pct} {text}"
    elif out["findings"]:
        out["summary"] = out["findings"][0]
    return out


def _findings(stats: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    tiers = stats.get("tiers") or {}
    ssd = tiers.get("ssd") or {}
    over = int((ssd.get("dropped_spills") or {}).get("write_budget", 0))
    if over:
        out.append(f"SSD writes over the daily write budget: {over} blocks were not written "
                   f"today ({_size(int(ssd.get('bytes_written_today') or 0))} written)")
    if ssd.get("degraded"):
        out.append(f"the SSD tier is degraded: {ssd.get('degraded_reason')}")
    redis = tiers.get("redis") or {}
    if redis and redis.get("healthy") is False:
        out.append(f"the shared Redis tier is unhealthy (circuit {redis.get('state')})")
    return out
