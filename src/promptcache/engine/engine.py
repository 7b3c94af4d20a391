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
waits for it, bounded (``calls.py``); the cache operations the server asks for a
request (``cache_port.py``) are such calls and degrade (None / 0, counted in
``engine_stats``) instead of failing the request. Request intake is ``submission.py``,
the chat-template surface ``prompting.py``, the KV sizing probe ``kv_size.py``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..cache import PromptCache
from ..config import CacheConfig
from ..meta import DEFAULT_TENANT, Namespace, validate_tenant
from ..serving_config import EngineConfig
from . import adapters
from .admission import Admission
from .arrivals import Arrivals
from .cache_port import CachePort
from .calls import EngineCalls
from .context import EngineContext, EngineCounters, LogitsHook
from .kv_size import kv_row_bytes, probe_caches
from .port import (
    ENGINE_CALL_TIMEOUT_S,
    EngineAPI,
)
from .prompting import Prompting
from .quant import from_config as _kv_quant_of
from .scheduler import Scheduler
from .shadow import ShadowVerifier
from .spec_cost import CostModel, cost_from_config
from .speculate import Speculator
from .submission import Submission
from .templates import ChatTemplate
from .vision import VisionEncoder
from .vision_cache import VisionCache

logger = logging.getLogger(__name__)

T = TypeVar("T")



# mlx's buffer cache is limited to 1 / CACHE_LIMIT_SHARE of the KV budget
CACHE_LIMIT_SHARE = 8


class Engine(Submission, Prompting, CachePort):
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
        cache: PromptCache | None = None,
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
        self._thread = threading.Thread(target=self._run, name="promptcache-engine", daemon=True)
        # calls to run on the engine thread (``call``) and how they went
        self.calls = EngineCalls(self._thread, self._control.wake, self._refusal)
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
        cache: PromptCache | None = None,
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


    @property
    def alive(self) -> bool:
        """False once the engine thread has died (``/health`` answers 503)."""
        return self._dead is None and self._thread.is_alive()

    @property
    def failure(self) -> str | None:
        return self._dead

    def engine_stats(self) -> dict[str, Any]:
        """Counters, admission (active, queued, waits, KV reserved / budget), the batch.
        Cheap and lock-free apart from the admission lock (safe from any thread)."""
        return {**self.counters.to_dict(), **self.admission.snapshot(),
                "alive": self.alive, "batch_size": len(self.scheduler.batch),
                **self.calls.stats,
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

    def call(self, fn: Callable[[], T], timeout: float | None = ENGINE_CALL_TIMEOUT_S) -> T:
        """Run ``fn()`` on the engine thread (``calls.EngineCalls.call``)."""
        return self.calls.call(fn, timeout)

    def _refusal(self) -> str | None:
        if self._dead is not None:
            return f"the engine thread died: {self._dead}"
        if self._closed or not self._thread.is_alive():
            return "the engine is closed"
        return None

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
            self.calls.fail(f"the engine thread died: {self._dead}" if self._dead
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
            if self.calls.pending:
                self.calls.run()
            if not sched.step():
                # idle: one chunk of shadow verification, then look for requests again
                # (a request that arrives waits at most that chunk)
                shadow = self.shadow
                if shadow is not None and shadow.pending and shadow.step():
                    continue
                self._control.wake.wait()
                self._control.wake.clear()
                if self.calls.pending:
                    self.calls.run()
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
        self._control.gather(cfg.batch_window_s, cfg.burst_gather_max_s, self.calls.run)

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
