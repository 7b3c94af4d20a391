"""The Engine: one thread owns the model; requests are submitted from any thread.
The caller builds the prompt cache and hands it in; ``close()`` closes it. If the engine thread
dies, pending requests end with an error and ``submit`` raises ``EngineDeadError``. The port's
methods are short delegates to the parts built here (submission, prompting, memory); its cache
calls are ``cache_port``'s."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from ..cache import PromptCache
from ..config import CacheConfig
from ..meta import DEFAULT_TENANT, Namespace
from ..serving_config import EngineConfig
from .api import GenerationRequest, GenerationResult, VisionInfo
from .cache_port import CachePort, Namespaces
from .context import EngineContext, EngineCounters, LogitsHook
from .formats.chat_format import ChatFormat, chat_format_of
from .formats.templates import ChatTemplate
from .memory import CACHE_LIMIT_SHARE, EngineMemory, cap_mlx_cache
from .models.vision import VisionEncoder
from .models.vision_cache import VisionCache
from .payload import adapters
from .payload.kv_size import kv_row_bytes, probe_caches
from .payload.live import LiveStates
from .payload.quant import from_config as _kv_quant_of
from .payload.shadow import ShadowVerifier
from .port import ENGINE_CALL_TIMEOUT_S, EngineAPI
from .prompting import Prompting
from .requests.admission import Admission
from .requests.arrivals import Arrivals
from .requests.calls import EngineCalls
from .requests.handles import RequestHandle
from .requests.loop import EngineLoop, stop_thread
from .requests.prefill import attention_heads
from .requests.scheduler import Scheduler
from .requests.splice import planner_for
from .requests.submission import Submission, preempt
from .speculation import make_speculator, spec_stats
from .steps import Steps, no_steps

logger = logging.getLogger(__name__)

T = TypeVar("T")



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
        cache: PromptCache | None = None,
        logits_hook: LogitsHook | None = None,
        vision: VisionEncoder | None = None,
        steps: Steps = no_steps,
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
        self.templates = ChatTemplate(tokenizer, token_limit=context_length,
                                      render_limit_s=cfg.template_render_limit_s)
        # a template that does not parse, loops or recurses refuses to start
        self.templates.check()
        eos = getattr(tokenizer, "eos_token_ids", None) or []
        self.counters = EngineCounters()
        self.namespaces = Namespaces(fingerprint, bs, self.kv_spec)
        self._closed = False
        self._dead: str | None = None
        self._control = Arrivals()
        self._thread = threading.Thread(target=self._run, name="promptcache-engine", daemon=True)
        # calls to run on the engine thread (``call``) and how they went
        self.calls = EngineCalls(self._thread, self._control.wake, self._refusal)
        self.planner = planner_for(cfg.restore_plan, template, cache)
        self.cache_port = CachePort(cache, self.calls, self.namespaces, self.kv_quant,
                                    self.planner)
        port = self.cache_port
        self._ctx = EngineContext(
            model=model, tokenizer=tokenizer, config=cfg, context_length=context_length,
            vocab_size=vocab_size, eos_token_ids=frozenset(int(t) for t in eos), cache=cache,
            namespace_for=self.namespaces if cache is not None else None, block_size=bs,
            counters=self.counters, logits_hook=logits_hook, vision=vision,
            kv_quant=self.kv_quant, planner=self.planner,
            speculator=make_speculator(cfg, model, vocab_size, (
                lambda t: port.token_history(t, cfg.spec_pool_tokens))
                if cache is not None else None, steps=steps),
        )
        if cache is not None and cfg.live_states > 0 and hasattr(cache, "hold_outside"):
            # the last turns' states, counted in the RAM tier's budget (engine/payload/live.py)
            live = LiveStates(cfg.live_states, cache.hold_outside, cache.drop_outside,
                              clock=cache.now, ttl_s=cache.config.ttl_seconds)
            cache.set_outside_holder(live.reclaim, live.forget)
            self._ctx.live = live
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
                                   on_preempt=preempt)
        self.submission = Submission(self._ctx, self.admission, self._control,
                                     failure=lambda: self._dead, closed=lambda: self._closed)
        self.prompting = Prompting(self.templates, self.submission.submit)
        self.scheduler = Scheduler(self._ctx, self.admission, self.submission.make_request)
        if cfg.active_kv_budget_bytes is not None:  # mlx's buffer cache: 1/8 of the KV budget
            cap_mlx_cache(cfg.active_kv_budget_bytes // CACHE_LIMIT_SHARE)
        # shadow verification of cache hits in idle time (engine/payload/shadow.py)
        self.shadow: ShadowVerifier | None = None
        if cfg.shadow_verify_fraction > 0 and self.kv_quant is not None:
            # a quantized block differs from its recomputation past the tolerance
            raise ValueError("shadow verification does not support quantized KV blocks "
                             "(--kv-bits) yet: use one or the other")
        if cache is not None and cfg.shadow_verify_fraction > 0 and hasattr(cache, "observers"):
            self.shadow = ShadowVerifier(model, cache, fraction=cfg.shadow_verify_fraction,
                                         chunk_tokens=cfg.prefill_chunk_tokens,
                                         busy=lambda: not self.scheduler.idle)
            cache.observers.append(self.shadow)
        self.memory = EngineMemory(cfg, cache, self._ctx.live, self.admission, self.row_bytes,
                                   sum(int(v.nbytes) for _, v in tree_flatten(model.parameters())),
                                   attention_heads(model))
        self.submission.memory_check = self.memory.check
        self.loop = EngineLoop(cfg, self.scheduler, self.admission, self.calls, self._control,
                               self.shadow, fail_pending=self.submission.fail_pending,
                               died=self._died, governor=self.memory.governor)
        self._thread.start()
        # stop the engine thread at interpreter exit even if close() was never called
        self._finalizer = weakref.finalize(self, stop_thread, self._control, self._thread)


    @classmethod
    def load(cls, model_path: str | Path, engine_config: EngineConfig | None = None,
             cache_config: CacheConfig | None = None, *, cache: PromptCache | None = None,
             logits_hook: LogitsHook | None = None, vision_cache: VisionCache | None = None,
             chat_template: str | None = None, steps: Steps = no_steps) -> Engine:
        """Load a model folder or repo id (a VLM through mlx-vlm; ``vision_cache`` caches
        its image features); ``cache``: built by the caller (MLXPayloadAdapter) or None."""
        from .models.loader import load_model_or_vlm

        model, tokenizer, info, tower = load_model_or_vlm(model_path, chat_template=chat_template,
                                                          steps=steps)
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
            logits_hook=logits_hook, vision=vision, steps=steps,
        )

    def namespace(self, tenant: str = DEFAULT_TENANT) -> Namespace:
        return self.namespaces(tenant)

    @property
    def chat_format(self) -> ChatFormat:
        """Reasoning markers and the template's thinking switch (engine/formats/chat_format.py)."""
        return chat_format_of(self.tokenizer)

    @property
    def vision(self) -> VisionInfo | None:
        """Image token, placeholder tokens per image and preprocessing settings of a
        vision-language model; None for a text-only model (images are a 400)."""
        return self.vision_encoder.info if self.vision_encoder is not None else None

    def render_chat(self, messages: Sequence[Mapping[str, Any]], tools: Any = None,
                    add_generation_prompt: bool = True, *,
                    continue_final_message: bool = False,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        return self.prompting.render_chat(messages, tools, add_generation_prompt,
                                          continue_final_message=continue_final_message,
                                          template_kwargs=template_kwargs)

    def render_chat_with_offsets(
        self, messages: Sequence[Mapping[str, Any]], tools: Any = None,
        add_generation_prompt: bool = True, *, continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], tuple[int, ...]]:
        return self.prompting.render_chat_with_offsets(
            messages, tools, add_generation_prompt,
            continue_final_message=continue_final_message, template_kwargs=template_kwargs)

    def encode_prompt(self, text: str) -> list[int]:
        return self.prompting.encode_prompt(text)

    def generate(self, prompt: Sequence[int] | Sequence[Mapping[str, Any]], *,
                 tenant: str = DEFAULT_TENANT, session_id: str | None = None,
                 use_cache: bool = True, tools: Any = None, **sampling: Any
                 ) -> GenerationResult:
        """Synchronous helper: token ids or chat messages in, the final result out."""
        return self.prompting.generate(prompt, tenant=tenant, session_id=session_id,
                                       use_cache=use_cache, tools=tools, **sampling)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        return self.submission.submit(request)

    def announce(self) -> Callable[[], None]:
        return self.submission.announce()

    def vision_stats(self) -> dict[str, Any] | None:
        """The vision-embedding cache's line; None for a text-only model."""
        return self.vision_encoder.stats() if self.vision_encoder is not None else None


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
                **spec_stats(self._ctx.speculator),
                **(self._ctx.live.stats() if self._ctx.live is not None else {}),
                "restore_rates": self.planner.rates.snapshot(),
                **(self.memory.governor.snapshot() if self.memory.governor is not None
                   else {}),
                # the RAM tier's MLX arrays (one per block; Metal caps ~499,000)
                "ram_arrays": self.cache.pool.num_blocks if self.cache is not None else 0,
                "max_arrays": self.cache.pool.max_blocks if self.cache is not None else None,
                # mlx's own accounting: alive, its buffer cache, the peak
                "mlx_active_bytes": int(mx.get_active_memory()),
                "mlx_cache_bytes": int(mx.get_cache_memory()),
                "mlx_peak_bytes": int(mx.get_peak_memory())}

    def release_live(self) -> int:
        """Release every live session state (what a memory governor asks first);
        returns the bytes released. Safe from any thread."""
        return self._ctx.live.clear() if self._ctx.live is not None else 0

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"engine": self.engine_stats()}
        if self.vision_encoder is not None:
            out["vision"] = self.vision_encoder.stats()
        if self.cache is not None:
            try:
                out["cache"] = self.cache.stats().to_dict()
            except Exception:
                logger.exception("cache stats failed")
            out["kv"] = self.cache_port.kv_stats()
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
        if self._ctx.live is not None:
            self._ctx.live.clear()
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

    def _run(self) -> None:
        self.loop.run()  # the engine thread (``loop.py``)

    def _died(self, reason: str) -> None:
        self._dead = reason


if TYPE_CHECKING:
    def _implements_the_port(engine: Engine) -> EngineAPI:
        return engine  # mypy: Engine implements EngineAPI (engine/port.py)
