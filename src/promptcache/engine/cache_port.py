"""The Engine's cache-facing port methods: lookups, protections, packs, cache stats;
the namespaces of its model (``Namespaces``)."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Sequence
from typing import Any

from .. import packfile, packs
from ..cache import PromptCache
from ..meta import DEFAULT_TENANT, ExtraKeySpan, Namespace, validate_tenant
from .payload.payload import ram_census
from .payload.planner import Planner
from .payload.quant import KVQuant
from .port import CachePrediction, CacheProbe, TunableCacheAPI
from .requests.calls import EngineCalls

logger = logging.getLogger(__name__)


class Namespaces:
    """The cache namespace of each tenant under one model (fingerprint, block size,
    KV format), built once per tenant."""

    def __init__(self, fingerprint: str, block_size: int, kv_spec: str) -> None:
        self._fingerprint = fingerprint
        self._block_size = block_size
        self._kv_spec = kv_spec
        self._namespaces: dict[str, Namespace] = {}

    def __call__(self, tenant: str = DEFAULT_TENANT) -> Namespace:
        ns = self._namespaces.get(tenant)
        if ns is None:
            validate_tenant(tenant)
            ns = Namespace(self._fingerprint, self._block_size, self._kv_spec, tenant)
            self._namespaces[tenant] = ns
        return ns


class CachePort:
    """The ``EngineAPI`` methods on the engine's prompt cache (``cache``; None without
    one). The lookups and changes for a request run on the engine thread (``calls``,
    ``EngineCalls.degrade``: None / 0 when they fail or time out); packs and stats are
    thread-safe calls on the cache. ``namespace``: a tenant's namespace under the
    model; ``kv_quant``: how stored blocks are quantized (None: full precision)."""

    def __init__(self, cache: PromptCache | None, calls: EngineCalls,
                 namespace: Callable[[str], Namespace], kv_quant: KVQuant | None,
                 planner: Planner | None = None) -> None:
        self.cache = cache
        self.planner = planner
        self.calls = calls
        self.namespace = namespace
        self.kv_quant = kv_quant

    def token_history(self, tenant: str, max_tokens: int) -> list[tuple[int, ...]]:
        """The token ids the cache stores for ``tenant`` under this model, at most
        ``max_tokens`` (the draft pool's seed; engine thread)."""
        if self.cache is None:
            return []
        seqs: list[tuple[int, ...]] = self.cache.token_history(self.namespace(tenant),
                                                               max_tokens)
        return seqs

    def kv_stats(self) -> dict[str, Any] | None:
        """What the RAM tier holds per cached token: arrays (one per block), bytes, the
        stored quantization (``payload.ram_census``); None without a cache."""
        return None if self.cache is None else ram_census(self.cache, self.kv_quant)

    @property
    def tunable_cache(self) -> TunableCacheAPI | None:
        """The cache when it reports to observers (the advisor, --auto-tune)."""
        cache = self.cache
        return cache if cache is not None and hasattr(cache, "observers") else None

    def predict_cached(self, tokens: Sequence[int], tenant: str,
                       extra_keys: Sequence[ExtraKeySpan] = ()) -> CachePrediction | None:
        """The cached tokens a prompt would get now (a lookup on the engine thread; at
        most ``len(tokens) - 1``) and the miss's cause; None without a cache or when
        the lookup failed."""
        cache = self.cache
        if cache is None:
            return None
        toks = list(tokens)

        def lookup() -> CachePrediction:
            ns = self.namespace(tenant)
            match = (cache.lookup(toks, ns, tuple(extra_keys)) if extra_keys
                     else cache.lookup(toks, ns))
            miss = match.miss
            return CachePrediction(max(0, min(int(match.num_tokens), len(toks) - 1)),
                                   miss.cause if miss is not None else None,
                                   whole=int(match.matched_tokens) >= len(toks) > 0)

        return self.calls.degrade("the cache lookup of a usage prediction", lookup, None)

    def probe_cache(self, tokens: Sequence[int], tenant: str,
                    extra_keys: Sequence[ExtraKeySpan] = (),
                    context_tokens: int = 0) -> CacheProbe | None:
        """A lookup explained (the probe endpoint; engine thread); None without a
        cache or when it failed."""
        cache = self.cache
        if cache is None:
            return None
        toks = list(tokens)
        extra = tuple(extra_keys)

        def probe() -> CacheProbe:
            ns = self.namespace(tenant)
            match = cache.lookup(toks, ns, extra) if extra else cache.lookup(toks, ns)
            miss = match.miss
            stored: tuple[int, ...] = ()
            if miss is not None and context_tokens > 0:
                position = min(int(miss.position), len(toks))
                stored = tuple(cache.stored_after(toks, ns, position, context_tokens,
                                                  extra_keys=extra))
            plan = (self.planner.decide(match, len(toks) - 1)
                    if self.planner is not None else None)
            return CacheProbe(int(match.num_tokens), int(match.matched_tokens),
                              {str(k): int(v) for k, v in dict(match.tokens_by_tier).items()},
                              miss, stored, plan.to_dict() if plan is not None else None)

        return self.calls.degrade("the cache probe's lookup", probe, None)

    def protect(self, tokens: Sequence[int], tenant: str, num_tokens: int, ttl_s: float, *,
                key: str | None = None, persist: bool = True, pin_s: float | None = None,
                extra_keys: Sequence[ExtraKeySpan] = ()) -> int:
        """``PromptCache.protect`` of ``tokens[:num_tokens]`` on the engine thread (after
        the blocks the engine stored); 0 without a cache or when it failed."""
        cache = self.cache
        if cache is None:
            return 0
        toks = list(tokens)

        def run() -> int:
            return int(cache.protect(toks, self.namespace(tenant), num_tokens, ttl_s, key=key,
                                     persist=persist, pin_s=pin_s,
                                     extra_keys=tuple(extra_keys)))

        return self.calls.degrade("protecting a prompt's blocks", run, 0)

    def mark_active(self, tokens: Sequence[int], tenant: str, session: str, *,
                    extra_keys: Sequence[ExtraKeySpan] = ()) -> int:
        """``PromptCache.mark_active`` (a session's latest chain) on the engine thread;
        0 without a cache or when it failed."""
        cache = self.cache
        if cache is None:
            return 0
        toks = list(tokens)

        def run() -> int:
            return int(cache.mark_active(toks, self.namespace(tenant), session,
                                         extra_keys=tuple(extra_keys)))

        return self.calls.degrade("marking a session's latest chain", run, 0)

    def export_pack(self, tenant: str, selection: dict[str, Any], *,
                    tokens: Sequence[int] | None = None,
                    session_id: str | None = None) -> tuple[bytes, dict[str, Any]]:
        """A pack (``packs.py``) of a conversation's cached prefix, a session or the
        whole tenant: ``(bytes, summary)``; ``PackError`` without a cache."""
        if self.cache is None:
            raise packfile.PackError("the prompt cache is disabled")
        ns = self.namespace(tenant)
        blocks = packs.collect(self.cache, ns, tokens=tokens,
                               session_id=session_id if tokens is None else None)
        buf = io.BytesIO()
        summary = packfile.write_pack(buf, ns, blocks, selection)
        return buf.getvalue(), summary

    def import_pack(self, pack: packfile.Pack) -> packfile.ImportReport:
        """Import a verified pack into its tenant under this model."""
        if self.cache is None:
            raise packfile.PackError("the prompt cache is disabled")
        return packs.import_into(self.cache, pack, self.namespace(pack.namespace.tenant))

    def cache_stats(self) -> dict[str, Any] | None:
        """The cache's stats with its protections and active sessions (``levels``);
        None without a cache."""
        cache = self.cache
        if cache is None:
            return None
        data: dict[str, Any] = dict(cache.stats().to_dict())
        if hasattr(cache, "levels_snapshot"):  # protections and active sessions
            data["levels"] = cache.levels_snapshot()
        return data

    def tier_health(self) -> dict[str, Any]:
        """``{tier name: tier.health()}`` for the lower tiers that report it (the SSD
        tier: ``mode`` read_write / read_only / off, ``degraded``, ``reason``): attribute
        reads only, no lock and no I/O, so /health stays cheap."""
        out: dict[str, Any] = {}
        for tier in getattr(self.cache, "lower", None) or ():
            health = getattr(tier, "health", None)
            if callable(health):
                name = str(getattr(tier, "name", type(tier).__name__))
                try:
                    out[name] = dict(health())
                except Exception as e:  # a broken tier must not break /health
                    out[name] = {"error": str(e)}
        return out
