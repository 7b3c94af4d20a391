"""The Engine: one thread owns the model; requests are submitted from any thread.

``submit`` validates a request (fast token validation, a constraint compiled into a
logits processor), takes an admission ticket (``admission.py``: active requests,
active KV bytes, a bounded wait queue; ``OverloadedError`` past it) and returns a
``RequestHandle`` at once. The engine thread runs the ``Scheduler``: every step one
batched decode forward over all decoding requests plus at most one prefill chunk.
The prompt cache is built by the caller and handed in (the engine never constructs
tiers); the engine closes it in ``close()``.

If the engine thread dies (a bug, not a model failure of one request, which only
ends that request), every pending request ends with an error, ``alive`` turns
False and ``submit`` raises ``EngineDeadError``.

The Engine implements the server's port (``port.EngineAPI``). ``call(fn)`` runs a
function on the engine thread between two steps (or while it gathers a burst) and
waits for it, bounded; the cache operations the server asks for a request
(``predict_cached``, ``probe_cache``, ``protect``, ``mark_active``) are such calls and
degrade (None / 0, counted in ``engine_stats``: ``engine_calls_failed`` /
``engine_calls_timed_out``) instead of failing the request.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from .. import packfile, packs
from ..config import CacheConfig
from ..errors import EngineDeadError, RequestError
from ..meta import DEFAULT_TENANT, ExtraKeySpan, Namespace, validate_tenant
from ..serving_config import EngineConfig
from . import adapters, constrained
from .admission import Admission, Ticket
from .api import GenerationRequest, GenerationResult, SamplingParams, Usage, VisionInfo
from .arrivals import Arrivals
from .chat_format import ChatFormat, chat_format_of
from .context import EngineContext, EngineCounters, LogitsHook, Processor, validate_request
from .handles import RequestHandle
from .payload import ram_census
from .port import (
    ENGINE_CALL_TIMEOUT_S,
    CachePrediction,
    CacheProbe,
    EngineAPI,
    TunableCacheAPI,
)
from .quant import from_config as _kv_quant_of
from .request import Request
from .scheduler import Scheduler
from .shadow import ShadowVerifier
from .spec_cost import CostModel, cost_from_config
from .speculate import Speculator
from .templates import ChatTemplate
from .vision import VisionEncoder
from .vision_cache import VisionCache

logger = logging.getLogger(__name__)

_SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)

T = TypeVar("T")


class EngineCallTimeout(TimeoutError):
    """``Engine.call``: the engine thread did not run the call in time."""


@dataclasses.dataclass(eq=False)
class _Call:
    """A function the engine thread runs between two steps (``Engine.call``)."""

    fn: Callable[[], Any]
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    value: Any = None
    error: BaseException | None = None
    abandoned: bool = False  # the caller stopped waiting: not run


@dataclasses.dataclass(eq=False)
class _Pending:
    """What a ticket carries until the engine thread starts the request."""

    request: GenerationRequest
    tokens: np.ndarray
    handle: RequestHandle
    processors: list[Processor]
    t_submit: float


KV_GROWTH_STEP = 256  # mlx-lm's KV caches grow in steps of this many tokens


def probe_caches(model: Any) -> list[Any]:
    """Fresh cache objects after a forward of one token (token id 0)."""
    caches = list(make_prompt_cache(model))
    mx.eval(model(mx.array([[0]]), cache=caches))
    return caches


# mlx's buffer cache is limited to 1 / CACHE_LIMIT_SHARE of the KV budget
CACHE_LIMIT_SHARE = 8


def kv_row_bytes(model: Any, probed: Sequence[Any] | None = None) -> Callable[[int], int]:
    """An upper bound of one request's cache bytes at ``n`` tokens, from a 1-token
    probe (``probed``: ``probe_caches(model)`` if given): full-attention KV grows per
    token (plus up to one growth step of unused room: mlx-lm's caches grow 256 tokens
    at a time), sliding windows stop at their size, array states (SSM) are constant."""
    caches = list(probed) if probed is not None else probe_caches(model)
    per_token = 0
    windows: list[tuple[int, int]] = []  # (bytes per token, window)
    fixed = 0
    for c in caches:
        leaves = list(getattr(c, "caches", [c]))
        for leaf in leaves:
            if isinstance(leaf, ArraysCache):
                fixed += sum(int(a.nbytes) for a in leaf.cache if a is not None)
                continue
            arrays = [a for _, a in adapters.state_arrays([leaf])]
            if not arrays:
                continue
            length = max(int(a.shape[2]) for a in arrays if a.ndim == 4)
            per = sum(int(a.nbytes) for a in arrays) // max(1, length)
            window = getattr(leaf, "max_size", None)
            if isinstance(window, int) and window > 0:
                windows.append((per, window))
            else:
                per_token += per

    def row_bytes(n: int) -> int:
        room = n + KV_GROWTH_STEP
        return per_token * room + sum(p * min(room, w) for p, w in windows) + fixed

    return row_bytes


class Engine:
    """Cache-aware, batched generation on one mlx-lm model."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_id: str,
        fingerprint: str,
        context_length: int,
        vocab_size: int,
        engine_config: EngineConfig | None = None,
        cache_config: CacheConfig | None = None,
        cache: Any | None = None,
        logits_hook: LogitsHook | None = None,
        vision: VisionEncoder | None = None,
    ) -> None:
        self.model = model
        # a vision-language model's image encoder (None: a text-only model)
        self.vision_encoder = vision
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.fingerprint = fingerprint
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.engine_config = engine_config or EngineConfig()
        self.cache_config = cache_config or CacheConfig()
        self.cache = cache
        cfg = self.engine_config
        bs = self.cache_config.block_size
        if cfg.prefill_chunk_tokens % bs != 0:
            raise ValueError(
                f"prefill_chunk_tokens ({cfg.prefill_chunk_tokens}) must be a "
                f"multiple of the block size ({bs})"
            )
        template = make_prompt_cache(model)
        window = adapters.min_sliding_tokens(template)
        if cache is not None and window is not None and bs > window:
            raise ValueError(
                f"block_size ({bs}) must not exceed the model's sliding window ({window} "
                "tokens past the kept ones): blocks are saved while their tokens are still "
                "in the window"
            )
        # stored blocks quantized per the cache config; the spec is part of the namespace
        self.kv_quant = _kv_quant_of(self.cache_config)
        try:
            self.kv_spec = adapters.kv_spec(model, template, quant=self.kv_quant)
        except ValueError as e:
            raise ValueError(f"model {model_id}: {e}") from e
        self.templates = ChatTemplate(tokenizer, token_limit=context_length)
        eos = getattr(tokenizer, "eos_token_ids", None) or []
        self.counters = EngineCounters()
        self._ctx = EngineContext(
            model=model, tokenizer=tokenizer, config=cfg, context_length=context_length,
            vocab_size=vocab_size, eos_token_ids=frozenset(int(t) for t in eos), cache=cache,
            namespace_for=self.namespace if cache is not None else None, block_size=bs,
            counters=self.counters, logits_hook=logits_hook, vision=vision,
            kv_quant=self.kv_quant,
            speculator=Speculator(cfg, self.counters, history=self._token_history
                                  if cache is not None else None,
                                  cost=_verify_cost(cfg, model, vocab_size))
            if cfg.speculation == "suffix" else None,
        )
        probed = probe_caches(model)
        if cache is not None:
            # a model whose cache cannot be stored is refused here, not at every save
            try:
                adapters.check_storable(model, probed, 1, quant=self.kv_quant)
            except ValueError as e:
                raise ValueError(f"model {model_id}: {e}") from e
        self.row_bytes = kv_row_bytes(model, probed)
        self.admission = Admission(cfg.max_active_requests, cfg.max_queued_requests,
                                   cfg.active_kv_budget_bytes, self.row_bytes,
                                   on_preempt=self._preempt)
        self.scheduler = Scheduler(self._ctx, self.admission, self._make_request)
        if cfg.active_kv_budget_bytes is not None:
            # mlx keeps freed buffers for reuse (its buffer cache; unbounded by default
            # on Metal): at most an eighth of the KV budget (the smallest over engines)
            limit = cfg.active_kv_budget_bytes // CACHE_LIMIT_SHARE
            previous = mx.set_cache_limit(limit)
            if previous < limit:
                mx.set_cache_limit(previous)
        # shadow verification of cache hits in idle time (engine/shadow.py)
        self.shadow: ShadowVerifier | None = None
        if cfg.shadow_verify_fraction > 0 and self.kv_quant is not None:
            # a quantized block differs from its recomputation by the quantization error,
            # far past the verifier's tolerance: every hit would look corrupt
            raise ValueError("shadow verification does not support quantized KV blocks "
                             "(--kv-bits) yet: use one or the other")
        if cache is not None and cfg.shadow_verify_fraction > 0 and hasattr(cache, "observers"):
            self.shadow = ShadowVerifier(model, cache, fraction=cfg.shadow_verify_fraction,
                                         chunk_tokens=cfg.prefill_chunk_tokens,
                                         busy=lambda: not self.scheduler.idle)
            cache.observers.append(self.shadow)
        self._namespaces: dict[str, Namespace] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._dead: str | None = None
        self._control = Arrivals()
        # calls to run on the engine thread (``call``) and how they went
        self._calls: deque[_Call] = deque()
        self._call_lock = threading.Lock()
        self.call_stats = {"engine_calls": 0, "engine_calls_failed": 0,
                           "engine_calls_timed_out": 0}
        self._thread = threading.Thread(target=self._run, name="promptcache-engine", daemon=True)
        self._thread.start()
        # stop the engine thread at interpreter exit even if close() was never called
        self._finalizer = weakref.finalize(self, _stop_thread, self._control, self._thread)

    # ------------------------------------------------------------------ construction

    @classmethod
    def load(
        cls,
        model_path: str | Path,
        engine_config: EngineConfig | None = None,
        cache_config: CacheConfig | None = None,
        *,
        cache: Any | None = None,
        logits_hook: LogitsHook | None = None,
        vision_cache: VisionCache | None = None,
    ) -> Engine:
        """Load a model folder or Hugging Face repo id. ``cache``: a PromptCache built
        by the caller (with ``engine.payload.MLXPayloadAdapter``), or None. A
        vision-language model folder (config with ``vision_config``) is loaded through
        mlx-vlm (``models/vlm.py``); ``vision_cache`` then caches its image features."""
        from .models.loader import load_model_or_vlm

        model, tokenizer, info, tower = load_model_or_vlm(model_path)
        vision = None
        if tower is not None:
            if vision_cache is not None:
                vision_cache.bind_model(info.fingerprint)
            vision = VisionEncoder(tower, vision_cache)
        cfg = info.config
        vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
        return cls(
            model, tokenizer, model_id=info.model_id, fingerprint=info.fingerprint,
            context_length=info.context_length, vocab_size=int(vocab or 2**32),
            engine_config=engine_config, cache_config=cache_config, cache=cache,
            logits_hook=logits_hook, vision=vision,
        )

    def namespace(self, tenant: str = DEFAULT_TENANT) -> Namespace:
        ns = self._namespaces.get(tenant)
        if ns is None:
            validate_tenant(tenant)
            ns = Namespace(self.fingerprint, self.cache_config.block_size, self.kv_spec, tenant)
            self._namespaces[tenant] = ns
        return ns

    # ------------------------------------------------------------------ chat templates

    @property
    def vision(self) -> VisionInfo | None:
        """Image token, placeholder tokens per image and preprocessing settings of a
        vision-language model; None for a text-only model (images are a 400)."""
        return self.vision_encoder.info if self.vision_encoder is not None else None

    @property
    def chat_format(self) -> ChatFormat:
        """Reasoning markers and the template's thinking switch (engine/chat_format.py)."""
        return chat_format_of(self.tokenizer)

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Any = None,
        add_generation_prompt: bool = True, *, continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Prompt token ids of a chat (see ``templates.ChatTemplate.render``); thread-safe."""
        return self.templates.render(messages, tools, add_generation_prompt,
                                     continue_final_message=continue_final_message,
                                     template_kwargs=template_kwargs)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a plain-text prompt (``/v1/completions``); a text that surely
        exceeds the context is refused after a bounded tokenization; thread-safe."""
        return self.templates.encode(text)

    def render_chat_with_offsets(
        self, messages: Sequence[Mapping[str, Any]], tools: Any = None,
        add_generation_prompt: bool = True, *, continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], tuple[int, ...]]:
        """``(tokens, message_starts)`` in one render + tokenization; thread-safe."""
        return self.templates.render_with_offsets(
            messages, tools, add_generation_prompt,
            continue_final_message=continue_final_message, template_kwargs=template_kwargs)

    # ------------------------------------------------------------------ requests

    @property
    def alive(self) -> bool:
        """False once the engine thread has died (``/health`` answers 503)."""
        return self._dead is None and self._thread.is_alive()

    @property
    def failure(self) -> str | None:
        return self._dead

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Validate and admit (or queue); returns at once. Raises ``RequestError`` (a
        ValueError), ``OverloadedError`` or ``EngineDeadError``."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine thread died: {self._dead}")
        if self._closed:
            raise RuntimeError("the engine is closed")
        tokens = validate_request(request, self._ctx)
        processors: list[Processor] = []
        if request.constraint is not None:
            processors.append(constrained.logits_processor(
                request.constraint, self.tokenizer, self.vocab_size))
        if not request.request_id:
            request = dataclasses.replace(request, request_id=f"req-{next(self._ids)}")
        handle = RequestHandle(request, on_cancel=self._on_cancel)
        pending = _Pending(request, tokens, handle, processors, time.perf_counter())
        length = int(tokens.shape[0]) + (0 if request.prefill_only else request.sampling.max_tokens)
        ticket = Ticket(pending, length, background=request.priority == "background")
        handle._ticket = ticket  # type: ignore[attr-defined]
        self.admission.submit(ticket)
        if self._dead is not None:  # died while we were admitting: nobody will take it
            self._fail_pending(f"the engine thread died: {self._dead}")
        self._control.wake.set()
        return handle

    def announce(self) -> Callable[[], None]:
        """The caller is preparing a request it will ``submit`` (the server announces
        every generation request before rendering its prompt): an idle engine gathering
        a burst waits for it (``arrivals.py``). Returns the release (idempotent), to
        call when the preparation ends, submitted or not. Thread-safe."""
        return self._control.announce()

    def _on_cancel(self, handle: RequestHandle) -> None:
        ticket: Ticket | None = getattr(handle, "_ticket", None)
        if ticket is not None and self.admission.cancel(ticket):
            self.counters.cancelled += 1
            handle._emit(_empty_result(handle.request, "cancelled", queue_s=0.0))
        self._control.wake.set()

    def _preempt(self, ticket: Ticket) -> None:
        """A background request gives its slot back to a waiting interactive one: it is
        cancelled (its saved blocks stay); the slot frees when the scheduler drops it."""
        p: _Pending = ticket.item
        logger.debug("background request %s preempted by a waiting interactive request",
                     p.request.request_id)
        p.handle.cancel()

    def _make_request(self, ticket: Ticket) -> Request | None:
        p: _Pending = ticket.item
        if p.handle.cancel_requested:
            p.handle._emit(_empty_result(p.request, "cancelled", ticket.queue_s))
            self.counters.cancelled += 1
            return None
        try:
            return Request(self._ctx, p.request, p.tokens, p.handle._emit,
                           cancelled=lambda: p.handle.cancel_requested,
                           processors=p.processors, queue_s=ticket.queue_s,
                           t_submit=p.t_submit)
        except Exception as e:  # one request that cannot start fails alone
            logger.exception("request %s could not start", p.request.request_id)
            self.counters.errors += 1
            p.handle._emit(_empty_result(p.request, "error", ticket.queue_s,
                                         f"{type(e).__name__}: {e}"))
            return None

    def generate(
        self,
        prompt: Sequence[int] | Sequence[Mapping[str, Any]],
        *,
        tenant: str = DEFAULT_TENANT,
        session_id: str | None = None,
        use_cache: bool = True,
        tools: Any = None,
        **sampling: Any,
    ) -> GenerationResult:
        """Synchronous helper: token ids or chat messages in, the final result out."""
        unknown = set(sampling) - _SAMPLING_FIELDS
        if unknown:
            raise RequestError(f"unknown sampling parameters: {sorted(unknown)}")
        for key in ("stop", "stop_token_ids"):
            if key in sampling and isinstance(sampling[key], (list, tuple)):
                sampling[key] = tuple(sampling[key])
            elif key in sampling and isinstance(sampling[key], str) and key == "stop":
                sampling[key] = (sampling[key],)
        starts: tuple[int, ...] = ()
        items = list(prompt)
        if items and isinstance(items[0], Mapping):
            tokens, starts = self.render_chat_with_offsets(items, tools)  # type: ignore[arg-type]
        else:
            tokens = items  # type: ignore[assignment]
        req = GenerationRequest(
            prompt_tokens=tuple(tokens), sampling=SamplingParams(**sampling), tenant=tenant,
            session_id=session_id, use_cache=use_cache, message_starts=starts,
        )
        return self.submit(req).result()

    def engine_stats(self) -> dict[str, Any]:
        """Counters, admission (active, queued, waits, KV reserved / budget), the batch.
        Cheap and lock-free apart from the admission lock (safe from any thread)."""
        return {**self.counters.to_dict(), **self.admission.snapshot(),
                "alive": self.alive, "batch_size": len(self.scheduler.batch),
                **self.call_stats,
                **self._spec_stats(),
                # mlx's own accounting: arrays alive (KV, RAM-tier blocks, weights), its
                # buffer cache (freed buffers it keeps for reuse) and the peak
                "mlx_active_bytes": int(mx.get_active_memory()),
                "mlx_cache_bytes": int(mx.get_cache_memory()),
                "mlx_peak_bytes": int(mx.get_peak_memory())}

    def _token_history(self, tenant: str) -> list[tuple[int, ...]]:
        """The token ids the cache stores for ``tenant`` under this model (the draft
        pool's seed; engine thread)."""
        if self.cache is None:
            return []
        seqs: list[tuple[int, ...]] = self.cache.token_history(
            self.namespace(tenant), self.engine_config.spec_pool_tokens)
        return seqs

    def _spec_stats(self) -> dict[str, Any]:
        """The draft pool's size and what the speculation counters mean: acceptance rate
        (accepted / drafted), mean accepted length (accepted / verify forwards) and tokens
        per verify forward (1 + that: the model's own token after each draft)."""
        spec = self._ctx.speculator
        c = self.counters
        v, d, a = c.spec_verifies, c.spec_drafted, c.spec_accepted
        relative = ({f"k{k}": round(spec.cost.relative(1, k + 1), 3) for k in (1, 2, 4, 8, 16)}
                    if spec is not None else {})
        return {"spec_pool_tokens": spec.pool_tokens() if spec is not None else 0,
                # one stream's verify forward of k drafts, in decode steps
                "spec_verify_cost": relative,
                "spec_pool_ngrams": spec.pools.num_ngrams() if spec is not None else 0,
                "spec_acceptance_rate": round(a / d, 4) if d else None,
                "spec_mean_accepted": round(a / v, 4) if v else None,
                "spec_tokens_per_forward": round(1 + a / v, 4) if v else None}

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"engine": self.engine_stats()}
        if self.vision_encoder is not None:
            out["vision"] = self.vision_encoder.stats()
        if self.cache is not None:
            try:
                out["cache"] = self.cache.stats().to_dict()
            except Exception:
                logger.exception("cache stats failed")
            out["kv"] = self.kv_stats()
        return out

    def kv_stats(self) -> dict[str, Any] | None:
        """What the RAM tier holds per cached token: arrays (one per block), bytes, the
        stored quantization (``payload.ram_census``); None without a cache."""
        return None if self.cache is None else ram_census(self.cache, self.kv_quant)

    # ------------------------------------------------------------------ the server's port

    @property
    def tunable_cache(self) -> TunableCacheAPI | None:
        """The cache when it reports to observers (the advisor, --auto-tune)."""
        cache = self.cache
        return cache if cache is not None and hasattr(cache, "observers") else None

    def call(self, fn: Callable[[], T], timeout: float | None = ENGINE_CALL_TIMEOUT_S) -> T:
        """Run ``fn()`` on the engine thread (between two steps, in order with the other
        calls) and return its result; raises what it raised, ``EngineCallTimeout`` when
        the engine thread did not run it within ``timeout`` seconds (it is then dropped),
        ``EngineDeadError`` once the engine thread is gone. On the engine thread itself
        ``fn`` runs at once."""
        if threading.current_thread() is self._thread:
            return fn()
        if self._dead is not None:
            raise EngineDeadError(f"the engine thread died: {self._dead}")
        if self._closed or not self._thread.is_alive():
            raise EngineDeadError("the engine is closed")
        job = _Call(fn)
        self._calls.append(job)
        self._control.wake.set()
        if not self._thread.is_alive():  # ended meanwhile: nobody will take it
            self._fail_calls("the engine is closed")
        if not job.done.wait(timeout):
            job.abandoned = True
            raise EngineCallTimeout(f"the engine thread did not run the call in {timeout} s")
        if job.error is not None:
            raise job.error
        return cast(T, job.value)

    def _degrade(self, what: str, fn: Callable[[], T], default: T,
                 timeout: float | None = ENGINE_CALL_TIMEOUT_S) -> T:
        """``call(fn)``, or ``default`` (logged and counted) when it fails or times out:
        an engine-thread call made for a request never fails the request."""
        try:
            value = self.call(fn, timeout)
        except EngineCallTimeout:
            self._count_call("engine_calls_timed_out")
            logger.warning("%s: the engine thread did not run it in %s s", what, timeout)
            return default
        except Exception:
            self._count_call("engine_calls_failed")
            logger.warning("%s failed", what, exc_info=True)
            return default
        self._count_call(None)
        return value

    def _count_call(self, outcome: str | None) -> None:
        with self._call_lock:  # callers on several threads
            self.call_stats["engine_calls"] += 1
            if outcome is not None:
                self.call_stats[outcome] += 1

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
                                   miss.cause if miss is not None else None)

        return self._degrade("the cache lookup of a usage prediction", lookup, None)

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
            return CacheProbe(int(match.num_tokens), int(match.matched_tokens),
                              {str(k): int(v) for k, v in dict(match.tokens_by_tier).items()},
                              miss, stored)

        return self._degrade("the cache probe's lookup", probe, None)

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

        return self._degrade("protecting a prompt's blocks", run, 0)

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

        return self._degrade("marking a session's latest chain", run, 0)

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

    def vision_stats(self) -> dict[str, Any] | None:
        """The vision-embedding cache's line; None for a text-only model."""
        return self.vision_encoder.stats() if self.vision_encoder is not None else None

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

    def close(self) -> None:
        """Stop the engine thread (active requests are cancelled) and close the cache."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        vcache = self.vision_encoder.cache if self.vision_encoder is not None else None
        if vcache is not None:
            try:
                vcache.close()
            except Exception:
                logger.exception("closing the vision cache failed")
        if self.cache is not None and hasattr(self.cache, "close"):
            try:
                self.cache.close()
            except Exception:
                logger.exception("closing the cache failed")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # the engine thread must never die silently
            self._dead = f"{type(e).__name__}: {e}"
            logger.critical("the engine thread died: %s", self._dead, exc_info=True)
            error = f"the engine thread died: {self._dead}"
            try:
                self.scheduler.fail_all(error)
            finally:
                self._fail_pending(error)
        finally:
            self._fail_calls(f"the engine thread died: {self._dead}" if self._dead
                             else "the engine was closed")
            # mlx keeps per-thread streams; destroy them before the thread ends, or the
            # process may abort at exit ("terminate called without an active exception")
            mx.synchronize()
            mx.clear_streams()

    def _loop(self) -> None:
        sched = self.scheduler
        while True:
            if self._control.stopping:
                sched.fail_all("the engine was closed", reason="cancelled")
                self._fail_pending(None)
                return
            if self._calls:
                self._run_calls()
            if not sched.step():
                # idle: one chunk of shadow verification, then look for requests again
                # (a request that arrives waits at most that chunk)
                shadow = self.shadow
                if shadow is not None and shadow.pending and shadow.step():
                    continue
                self._control.wake.wait()
                self._control.wake.clear()
                if self._calls:
                    self._run_calls()
                    if not self.admission.has_ready:  # woken by a call, not an arrival
                        continue
                self._gather_burst()

    def _gather_burst(self) -> None:
        """Woken from idle by an arrival: wait for the rest of a burst (``arrivals.py``:
        arrivals within ``batch_window_s`` of each other, and requests the server has
        announced and is still preparing, at most ``burst_gather_max_s``), so that
        requests sent together prefill as one batch instead of the first one alone and
        the rest after it."""
        cfg = self.engine_config
        self._control.gather(cfg.batch_window_s, cfg.burst_gather_max_s, self._run_calls)

    def _run_calls(self) -> None:
        """Run the waiting ``call``s (engine thread), in the order they came."""
        while True:
            try:
                job = self._calls.popleft()
            except IndexError:
                return
            if job.abandoned:
                continue
            try:
                job.value = job.fn()
            except Exception as e:  # the caller gets it; the engine thread goes on
                job.error = e
            finally:
                job.done.set()

    def _fail_calls(self, error: str) -> None:
        """Answer every waiting call (the engine thread is ending)."""
        while True:
            try:
                job = self._calls.popleft()
            except IndexError:
                return
            job.error = EngineDeadError(error)
            job.done.set()

    def _fail_pending(self, error: str | None) -> None:
        """Answer every ticket that was never started (error, or cancelled on close)."""
        for t in self.admission.drain():
            p: _Pending = t.item
            reason = "error" if error is not None else "cancelled"
            p.handle._emit(_empty_result(p.request, reason, t.queue_s, error))


def _empty_result(req: GenerationRequest, reason: str, queue_s: float,
                  error: str | None = None) -> GenerationResult:
    return GenerationResult(tokens=[], text="", finish_reason=reason,
                            usage=Usage(prompt_tokens=len(req.prompt_tokens)), error=error,
                            queue_s=queue_s)


def _stop_thread(control: Arrivals, thread: threading.Thread) -> None:
    control.stopping = True
    control.wake.set()
    if thread.is_alive() and thread is not threading.current_thread():
        thread.join(timeout=60)


def _verify_cost(cfg: EngineConfig, model: Any, vocab_size: int) -> CostModel:
    """The verify forward's cost for speculation's gate (``spec_cost.cost_from_config``)."""
    return cost_from_config(cfg.spec_verify_cost, model, vocab_size)


if TYPE_CHECKING:
    def _implements_the_port(engine: Engine) -> EngineAPI:
        return engine  # mypy: Engine implements EngineAPI (engine/port.py)
