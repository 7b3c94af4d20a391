"""Prometheus metrics: one ``CollectorRegistry`` per app (no global state). Request metrics are
counted as requests finish; cache metrics are read from ``cache.stats()`` at scrape time and
flattened (``{"bytes_by_tier": {"ram": 10}}`` -> ``promptcache_cache_bytes_by_tier{tier="ram"}``)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

TIER_NAMES = frozenset({"ram", "ssd", "redis", "disk", "none", "miss"})
_BAD = re.compile(r"[^a-zA-Z0-9_]")
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def _name(*parts: str) -> str:
    return _BAD.sub("_", "_".join(p for p in parts if p)).lower()


_LABEL_FOR_KEY = {"saves": "save_point", "blocks_saved": "save_point",
                  "dropped_spills": "reason"}


def _label_name(key: str) -> str:
    if "_by_" in key:
        return _name(key.rsplit("_by_", 1)[1])
    return _LABEL_FOR_KEY.get(key, "key")


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def flatten_stats(stats: Mapping[str, Any], prefix: str = "") -> Iterator[
        tuple[str, dict[str, str], float]]:
    """Yield (name, labels, value) for every number in a nested stats mapping.

    A mapping whose keys are all tier names becomes a ``tier`` label; a mapping of
    plain numbers becomes a label named after the key (``x_by_cause`` -> ``cause``);
    other nested mappings extend the name. Strings and lists are skipped."""
    for key, value in stats.items():
        key = str(key)
        if isinstance(value, bool) or _is_number(value):
            yield _name(prefix, key), {}, float(value)
        elif isinstance(value, Mapping) and value:
            if all(str(k).lower() in TIER_NAMES for k in value):
                for tier, sub in value.items():
                    if isinstance(sub, Mapping):
                        for name, labels, v in flatten_stats(sub, prefix):
                            yield name, {"tier": str(tier), **labels}, v
                    elif _is_number(sub):
                        yield _name(prefix, key), {"tier": str(tier)}, float(sub)
            elif all(_is_number(v) for v in value.values()):
                label = _label_name(key)
                for k, v in value.items():
                    yield _name(prefix, key), {label: str(k)}, float(v)
            else:
                yield from flatten_stats(value, _name(prefix, key))


def derived_stats(stats: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, str], float]]:
    """Token hit rate per tier: hit tokens of the tier / all looked-up prompt tokens."""
    by_tier = stats.get("hit_tokens_by_tier")
    total = stats.get("hit_tokens", 0) + stats.get("miss_tokens", 0) \
        if _is_number(stats.get("hit_tokens")) and _is_number(stats.get("miss_tokens")) else 0
    if isinstance(by_tier, Mapping) and total:
        for tier, n in by_tier.items():
            if _is_number(n):
                yield "token_hit_rate_per_tier", {"tier": str(tier)}, n / total


class CacheStatsCollector(Collector):
    def __init__(self, get_stats: Callable[[], Mapping[str, Any] | None]) -> None:
        self._get_stats = get_stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            stats = self._get_stats()
        except Exception:  # a failing cache never breaks a scrape
            log.warning("cache stats unavailable for /metrics", exc_info=True)
            return
        if not stats:
            return
        families: dict[tuple[str, tuple[str, ...]], GaugeMetricFamily] = {}
        for name, labels, value in (*flatten_stats(stats), *derived_stats(stats)):
            full = _name("promptcache_cache", name)
            keys = tuple(sorted(labels))
            fam = families.get((full, keys))
            if fam is None:
                if any(f == full for f, _ in families):
                    continue  # same name with other labels: not allowed by Prometheus
                fam = GaugeMetricFamily(full, f"cache stat {name}", labels=list(keys))
                families[(full, keys)] = fam
            fam.add_metric([labels[k] for k in keys], value)
        yield from families.values()


class EngineStatsCollector(Collector):
    """``engine.engine_stats()`` at scrape time: ``promptcache_engine_<name>`` gauges
    (active_kv_bytes, peak_active_kv_bytes, active, queued, kv_reserved_bytes,
    kv_budget_bytes, batch_size, rejected, wait_s_max, ...; ``alive`` as 0/1). A
    mapping of numbers keyed ``x_by_<label>`` becomes one family with that label: a
    counter for the monotonic ones (``store_errors_by_cause`` ->
    ``promptcache_engine_store_errors_by_cause_total{cause="layout"}``), else a gauge."""

    COUNTERS = frozenset({"store_errors_by_cause", "restore_plans_by_kind",
                          "restore_plans_by_why"})

    def __init__(self, get_stats: Callable[[], Mapping[str, Any] | None]) -> None:
        self._get_stats = get_stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        try:
            stats = self._get_stats()
        except Exception:
            log.warning("engine stats unavailable for /metrics", exc_info=True)
            return
        for key, value in (stats or {}).items():
            key = str(key)
            name = _name("promptcache_engine", key)
            if isinstance(value, bool) or _is_number(value):
                fam = GaugeMetricFamily(name, f"engine stat {key}")
                fam.add_metric([], float(value))
                yield fam
            elif (isinstance(value, Mapping) and "_by_" in key
                  and all(_is_number(v) for v in value.values())):
                label = _label_name(key)
                labelled: GaugeMetricFamily | CounterMetricFamily = (
                    CounterMetricFamily(name, f"engine counter {key}", labels=[label])
                    if key in self.COUNTERS
                    else GaugeMetricFamily(name, f"engine stat {key}", labels=[label]))
                for k, v in value.items():
                    labelled.add_metric([str(k)], float(v))
                yield labelled


class EdgeCollector(Collector):
    """The HTTP edge's connections (``server/edge.py``, ``Connections.counts()``) at
    scrape time: ``promptcache_edge_connections{phase}`` (open now, by phase) and
    ``promptcache_edge_events_total{event}``: ``refused`` (a new connection answered 503,
    every other one busy), ``evicted`` (closed to make room under --max-connections),
    ``head_timeouts`` (no whole request head within --header-timeout),
    ``oversized_heads`` (431), ``body_timeouts`` (408: no whole body within
    --body-timeout)."""

    PHASES = ("head", "busy", "idle", "linger")

    def __init__(self, counts: Callable[[], Mapping[str, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        counts = self._counts()
        open_ = GaugeMetricFamily("promptcache_edge_connections",
                                  "open HTTP connections by phase", labels=["phase"])
        events = CounterMetricFamily("promptcache_edge_events",
                                     "connections the HTTP edge refused or closed",
                                     labels=["event"])
        for key, value in counts.items():
            if key in self.PHASES:
                open_.add_metric([key], float(value))
            elif key != "open":
                events.add_metric([key], float(value))
        yield open_
        yield events


class ServerMetrics:
    def __init__(self, get_cache_stats: Callable[[], Mapping[str, Any] | None],
                 get_engine_stats: Callable[[], Mapping[str, Any] | None] | None = None
                 ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("promptcache_requests", "HTTP generation requests",
                                ["api", "status"], registry=r)
        self.ttft = Histogram("promptcache_ttft_seconds", "time to first token",
                              ["api"], buckets=_TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("promptcache_prompt_tokens", "prompt tokens", registry=r)
        self.cached_tokens = Counter("promptcache_cached_tokens",
                                     "prompt tokens served from the cache", ["tier"], registry=r)
        self.generated_tokens = Counter("promptcache_generated_tokens", "generated tokens",
                                        registry=r)
        self.in_flight = Gauge("promptcache_requests_in_flight", "requests being generated",
                               registry=r)
        self.rolling_hit_rate = Gauge("promptcache_rolling_token_hit_rate",
                                      "share of the tokens repeated from earlier traffic "
                                      "reused, over the alert window", registry=r)
        self.alert = Gauge("promptcache_hit_rate_alert",
                           "1 while the rolling hit rate is below the threshold", registry=r)
        self.queue_wait = Histogram("promptcache_queue_wait_seconds",
                                    "time a request waited for admission", buckets=_WAIT_BUCKETS,
                                    registry=r)
        self.template_errors = Counter(
            "promptcache_template_render_errors", "chat template renders that failed, by "
            "cause: timeout (past --template-render-limit), recursion, syntax", ["cause"],
            registry=r)
        self.imports_refused = Counter(
            "promptcache_imports_refused", "cache-pack imports refused, by reason: too_large "
            "(--max-import-bytes), invalid_pack", ["reason"], registry=r)
        self.import_refused_bytes = Counter(
            "promptcache_import_refused_bytes", "bytes of refused cache-pack imports: the "
            "body received before the refusal, or the Content-Length refused unread",
            registry=r)
        r.register(CacheStatsCollector(get_cache_stats))
        if get_engine_stats is not None:
            r.register(EngineStatsCollector(get_engine_stats))

    def watch_edge(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """Export the HTTP edge's connections and events (``EdgeCollector``)."""
        self.registry.register(EdgeCollector(counts))

    def template_error(self, cause: str) -> None:
        self.template_errors.labels(cause=cause).inc()

    def import_refused(self, reason: str, nbytes: int) -> None:
        self.imports_refused.labels(reason=reason).inc()
        self.import_refused_bytes.inc(nbytes)

    def observe_result(self, api: str, prompt_tokens: int, cached_by_tier: Mapping[str, int],
                       completion_tokens: int, ttft_s: float | None) -> None:
        self.requests.labels(api=api, status="ok").inc()
        self.prompt_tokens.inc(prompt_tokens)
        for tier, n in cached_by_tier.items():
            if n:
                self.cached_tokens.labels(tier=tier).inc(n)
        self.generated_tokens.inc(completion_tokens)
        if ttft_s is not None:
            self.ttft.labels(api=api).observe(ttft_s)

    def observe_failure(self, api: str, status: str) -> None:
        self.requests.labels(api=api, status=status).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
