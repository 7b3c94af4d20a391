"""The typed port between the server and the engine: ``EngineAPI`` and ``CacheAPI``.
The server holds an ``EngineAPI`` and nothing else of the engine (``Engine`` and the tests' fakes
implement it, checked by mypy); optional parts are Optional, never found with ``getattr``.
Calls on the cache's chains for a request run on the engine thread (``Engine.call``: bounded,
degrading to None / 0); admin reads and deletions are thread-safe ``CacheAPI`` calls."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..meta import ExtraKeySpan, Namespace
from ..packfile import ImportReport, Pack
from ..serving_config import EngineConfig
from .api import CacheMiss, GenerationRequest, GenerationResult, TokenEvent, VisionInfo
from .formats.chat_format import ChatFormat

# seconds a server call waits for the engine thread (the engine runs it between two
# steps: a step is one decode forward plus at most one prefill chunk)
ENGINE_CALL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class CachePrediction:
    """What a lookup of a prompt predicts before it is submitted: ``num_tokens`` cached
    (at most ``len(prompt) - 1``: the last token is always computed) and the miss's
    cause (None on a full hit). ``whole``: the cache already holds every token of the
    prompt (the request will store no prompt block: nothing is written for it)."""

    num_tokens: int
    cause: str | None = None
    whole: bool = False


@dataclass(frozen=True)
class CacheProbe:
    """A lookup explained (``POST /v1/cache/probe``): restorable tokens (not clamped),
    the token LCP found (restorable or not), tokens per tier, the miss, and up to
    ``context_tokens`` stored tokens after the miss position (what the cache holds
    where the prompt diverges)."""

    num_tokens: int
    matched_tokens: int
    tokens_by_tier: Mapping[str, int] = field(default_factory=dict)
    miss: CacheMiss | None = None
    stored_after: tuple[int, ...] = ()
    # the restore-or-recompute plan a turn would take (``Plan.to_dict``; None: no
    # lower-tier block in the match, nothing to decide)
    restore_plan: Mapping[str, Any] | None = None


class TokenizerAPI(Protocol):
    """The tokenizer bits the server uses (decoding for diagnostics and reasoning)."""

    def decode(self, tokens: list[int]) -> str: ...


class HandleAPI(Protocol):
    """A submitted request (``engine/requests/handles.py``): its events, then one result."""

    @property
    def request(self) -> GenerationRequest: ...

    def cancel(self) -> None: ...

    def aevents(self) -> AsyncIterator[TokenEvent | GenerationResult]: ...


class ShadowAPI(Protocol):
    """Shadow verification of cache hits (``engine/payload/shadow.py``)."""

    @property
    def alerting(self) -> bool: ...

    def snapshot(self) -> dict[str, Any]: ...


class StatsAPI(Protocol):
    def to_dict(self) -> dict[str, Any]: ...


class CacheAPI(Protocol):
    """The prompt cache as the server's operations use it: stats, session lists and
    deletions (thread-safe; the cache takes its own lock)."""

    def stats(self) -> StatsAPI: ...

    def delete(self, tenant: str | None = None) -> int: ...

    def delete_session(self, session_id: str, tenant: str | None = None) -> int: ...

    def sessions(self, tenant: str | None = None) -> list[dict[str, Any]]: ...


class PoolAPI(Protocol):
    @property
    def budget_bytes(self) -> int: ...


class TunableCacheAPI(CacheAPI, Protocol):
    """A cache that reports its events to observers and has a RAM budget: what the
    eviction advisor and ``--auto-tune`` watch and change (``advisor.py``,
    ``autotune.py``)."""

    @property
    def observers(self) -> list[Any]: ...

    @property
    def pool(self) -> PoolAPI: ...


class CachePortAPI(Protocol):
    """The engine's calls on its prompt cache (``engine/cache_port.py``; None / 0 / {} without
    a cache)."""

    @property
    def tunable_cache(self) -> TunableCacheAPI | None: ...

    # ---- the cache, on the engine thread (degrade: None / 0 on a failure or timeout)
    def predict_cached(self, tokens: Sequence[int], tenant: str,
                       extra_keys: Sequence[ExtraKeySpan] = ()) -> CachePrediction | None: ...

    def probe_cache(self, tokens: Sequence[int], tenant: str,
                    extra_keys: Sequence[ExtraKeySpan] = (),
                    context_tokens: int = 0) -> CacheProbe | None: ...

    def protect(self, tokens: Sequence[int], tenant: str, num_tokens: int, ttl_s: float, *,
                key: str | None = None, persist: bool = True, pin_s: float | None = None,
                extra_keys: Sequence[ExtraKeySpan] = ()) -> int: ...

    def mark_active(self, tokens: Sequence[int], tenant: str, session: str, *,
                    extra_keys: Sequence[ExtraKeySpan] = ()) -> int: ...

    # ---- packs (worker threads)
    def export_pack(self, tenant: str, selection: dict[str, Any], *,
                    tokens: Sequence[int] | None = None,
                    session_id: str | None = None) -> tuple[bytes, dict[str, Any]]: ...

    def import_pack(self, pack: Pack) -> ImportReport: ...

    def kv_stats(self) -> dict[str, Any] | None: ...

    def cache_stats(self) -> dict[str, Any] | None: ...

    def tier_health(self) -> dict[str, Any]: ...


class EngineAPI(Protocol):
    """Everything the server uses of an engine (see the module docstring)."""

    # ---- identity and configuration
    @property
    def model_id(self) -> str: ...

    @property
    def context_length(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def engine_config(self) -> EngineConfig: ...

    @property
    def tokenizer(self) -> TokenizerAPI: ...

    @property
    def chat_format(self) -> ChatFormat: ...

    @property
    def vision(self) -> VisionInfo | None: ...

    @property
    def alive(self) -> bool: ...

    @property
    def failure(self) -> str | None: ...

    # ---- optional capabilities
    @property
    def cache(self) -> CacheAPI | None: ...

    @property
    def shadow(self) -> ShadowAPI | None: ...

    @property
    def cache_port(self) -> CachePortAPI: ...

    def namespace(self, tenant: str = ...) -> Namespace: ...

    # ---- prompts (thread-safe)
    def render_chat(self, messages: Sequence[Mapping[str, Any]], tools: Any = None,
                    add_generation_prompt: bool = True, *,
                    continue_final_message: bool = False,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]: ...

    def render_chat_with_offsets(
        self, messages: Sequence[Mapping[str, Any]], tools: Any = None,
        add_generation_prompt: bool = True, *, continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], Sequence[int]]: ...

    def encode_prompt(self, text: str) -> list[int]: ...

    # ---- requests
    def submit(self, request: GenerationRequest) -> HandleAPI: ...

    def announce(self) -> Callable[[], None]: ...

    # ---- stats (None: the engine does not report them)
    def engine_stats(self) -> dict[str, Any] | None: ...

    def vision_stats(self) -> dict[str, Any] | None: ...
