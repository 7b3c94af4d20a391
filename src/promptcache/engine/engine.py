"""The Engine: one thread owns the model; requests are submitted from any thread.

``submit`` validates a request and returns a ``RequestHandle`` at once. The
engine thread keeps a list of active ``GenerationTask``s and advances each by one
unit of work (lookup + restore, one prefill chunk, or one decode step) per
scheduler tick, so a long prefill does not stall a running stream. Events flow
back through a per-request queue (``events()`` / ``aevents()``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..config import CacheConfig, EngineConfig, RedisConfig, SSDConfig
from ..errors import RequestError
from ..meta import DEFAULT_TENANT, Namespace, validate_tenant
from . import adapters
from .api import GenerationRequest, GenerationResult, SamplingParams, TokenEvent
from .chat_format import chat_format_of
from .generate import (
    EngineCounters,
    Event,
    GenContext,
    GenerationTask,
    LogitsHook,
    validate_request,
)
from .payload import MLXPayloadAdapter

logger = logging.getLogger(__name__)

_SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)


class RequestHandle:
    """The caller's side of one request: events, cancellation, the final result."""

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self._q: queue.Queue[Event] = queue.Queue()
        self._done = threading.Event()
        self._result: GenerationResult | None = None
        self._consumed = False
        self._task: GenerationTask | None = None
        self._cancel_requested = False
        self._lock = threading.Lock()
        self._async: tuple[asyncio.AbstractEventLoop, asyncio.Queue[Event]] | None = None

    def _emit(self, ev: Event) -> None:
        with self._lock:
            if isinstance(ev, GenerationResult):
                self._result = ev
                self._done.set()
            if self._async is not None:
                loop, aq = self._async
                try:
                    loop.call_soon_threadsafe(aq.put_nowait, ev)
                except RuntimeError:  # the consumer's event loop is closed: nobody listens
                    logger.debug("dropping an event for a closed event loop")
            else:
                self._q.put(ev)

    def _attach(self, task: GenerationTask) -> None:
        self._task = task
        if self._cancel_requested:
            task.cancel()

    def cancel(self) -> None:
        """Stop the request (e.g. client disconnect). Blocks already saved stay saved."""
        self._cancel_requested = True
        if self._task is not None:
            self._task.cancel()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def events(self) -> Iterator[TokenEvent | GenerationResult]:
        """Blocking iterator: TokenEvent ..., then the GenerationResult (single consumer)."""
        if self._consumed:
            raise RuntimeError("the events of a request can be consumed only once")
        self._consumed = True
        while True:
            ev = self._q.get()
            yield ev
            if isinstance(ev, GenerationResult):
                return

    async def aevents(self) -> AsyncIterator[TokenEvent | GenerationResult]:
        """The same events for asyncio code (delivered with ``call_soon_threadsafe``,
        so no worker thread is held per stream)."""
        if self._consumed:
            raise RuntimeError("the events of a request can be consumed only once")
        self._consumed = True
        aq: asyncio.Queue[Event] = asyncio.Queue()
        with self._lock:
            while True:  # events emitted before we started listening
                try:
                    aq.put_nowait(self._q.get_nowait())
                except queue.Empty:
                    break
            self._async = (asyncio.get_running_loop(), aq)
        while True:
            ev = await aq.get()
            yield ev
            if isinstance(ev, GenerationResult):
                return

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Wait for the final result (works whether or not events were consumed)."""
        if not self._done.wait(timeout):
            raise TimeoutError("the request did not finish in time")
        if self._result is None:  # pragma: no cover - _done is set only with a result
            raise RuntimeError("request finished without a result")
        return self._result


class Engine:
    """Cache-aware generation on one mlx-lm model."""

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
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.fingerprint = fingerprint
        self.context_length = context_length
        self.engine_config = engine_config or EngineConfig()
        self.cache_config = cache_config or CacheConfig()
        self.cache = cache
        bs = self.cache_config.block_size
        if self.engine_config.prefill_chunk_tokens % bs != 0:
            raise ValueError(
                f"prefill_chunk_tokens ({self.engine_config.prefill_chunk_tokens}) must be a "
                f"multiple of the block size ({bs})"
            )
        template = make_prompt_cache(model)
        window = adapters.min_window(template)
        if cache is not None and window is not None and bs > window:
            raise ValueError(
                f"block_size ({bs}) must not exceed the model's sliding window ({window}): "
                "blocks are saved while their tokens are still in the window"
            )
        self.kv_spec = adapters.kv_spec(model, template)
        eos = getattr(tokenizer, "eos_token_ids", None) or []
        self.counters = EngineCounters()
        self._ctx = GenContext(
            model=model,
            tokenizer=tokenizer,
            config=self.engine_config,
            context_length=context_length,
            vocab_size=vocab_size,
            eos_token_ids=frozenset(int(t) for t in eos),
            cache=cache,
            namespace_for=self.namespace if cache is not None else None,
            block_size=bs,
            counters=self.counters,
            logits_hook=logits_hook,
        )
        self._namespaces: dict[str, Namespace] = {}
        self._inbox: queue.Queue[tuple[GenerationTask, RequestHandle] | None] = queue.Queue()
        self._ids = itertools.count(1)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="promptcache-engine", daemon=True)
        self._thread.start()
        # stop the engine thread at interpreter exit even if close() was never called
        self._finalizer = weakref.finalize(self, _stop_thread, self._inbox, self._thread)

    # ------------------------------------------------------------------ construction

    @classmethod
    def load(
        cls,
        model_path: str | Path,
        engine_config: EngineConfig | None = None,
        cache_config: CacheConfig | None = None,
        ssd_config: SSDConfig | None = None,
        use_cache: bool = True,
        logits_hook: LogitsHook | None = None,
        redis_config: RedisConfig | None = None,
    ) -> Engine:
        """Load a model folder or Hugging Face repo id; build the cache (RAM [+ SSD]
        [+ Redis])."""
        from .models.loader import load_model

        model, tokenizer, info = load_model(model_path)
        cache_config = cache_config or CacheConfig()
        cache = None
        if use_cache and cache_config.enabled:
            cache = _build_cache(cache_config, ssd_config, redis_config)
        cfg = info.config
        vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
        return cls(
            model, tokenizer, model_id=info.model_id, fingerprint=info.fingerprint,
            context_length=info.context_length, vocab_size=int(vocab or 2**32),
            engine_config=engine_config, cache_config=cache_config, cache=cache,
            logits_hook=logits_hook,
        )

    def namespace(self, tenant: str = DEFAULT_TENANT) -> Namespace:
        ns = self._namespaces.get(tenant)
        if ns is None:
            validate_tenant(tenant)
            ns = Namespace(self.fingerprint, self.cache_config.block_size, self.kv_spec, tenant)
            self._namespaces[tenant] = ns
        return ns

    # ------------------------------------------------------------------ chat templates

    chat_format = property(lambda self: chat_format_of(self.tokenizer))  # engine/chat_format.py

    def _apply_template(
        self, messages: Sequence[Mapping[str, Any]], tools: Any, gen: bool,
        continue_final_message: bool = False, template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        kwargs = dict(template_kwargs or {})
        if continue_final_message:
            kwargs["continue_final_message"] = True
            gen = False
        out = self.tokenizer.apply_chat_template(
            list(messages), tools=tools, add_generation_prompt=gen, tokenize=True, **kwargs
        )
        if isinstance(out, Mapping):
            out = out["input_ids"]
        return [int(t) for t in out]

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Any = None,
        add_generation_prompt: bool = True, *, continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Prompt token ids of a chat, through the tokenizer's chat template.

        ``continue_final_message``: the last (assistant) message is left open so the
        model continues it (an Anthropic / OpenAI assistant prefill) instead of a new
        turn. ``template_kwargs``: extra template variables (e.g. ``enable_thinking``).
        """
        _validate_messages(messages)
        return self._apply_template(messages, tools, add_generation_prompt,
                                    continue_final_message, template_kwargs)

    def render_chat_with_offsets(
        self, messages: Sequence[Mapping[str, Any]], tools: Any = None,
        add_generation_prompt: bool = True, *, continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], tuple[int, ...]]:
        """``(tokens, message_starts)``: where each message starts (for miss explanations)."""
        tokens = self.render_chat(messages, tools, add_generation_prompt,
                                  continue_final_message=continue_final_message,
                                  template_kwargs=template_kwargs)
        starts = [0]
        for i in range(1, len(messages)):
            prefix = self._apply_template(messages[:i], tools, False, False, template_kwargs)
            n = 0
            for a, b in zip(prefix, tokens, strict=False):
                if a != b:
                    break
                n += 1
            starts.append(n)
        return tokens, tuple(starts)

    # ------------------------------------------------------------------ requests

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Validate and enqueue; returns at once. Raises ``RequestError`` (a ValueError)."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        tokens = validate_request(request, self._ctx)
        if not request.request_id:
            request = _replace(request, request_id=f"req-{next(self._ids)}")
        handle = RequestHandle(request)
        task = GenerationTask(self._ctx, request, handle._emit, prompt_tokens=tokens)
        handle._attach(task)
        self._inbox.put((task, handle))
        return handle

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

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"engine": self.counters.to_dict()}
        if self.cache is not None:
            try:
                out["cache"] = self.cache.stats().to_dict()
            except Exception:
                logger.exception("cache stats failed")
        return out

    def close(self) -> None:
        """Stop the engine thread (active requests are cancelled) and close the cache."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()
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
        finally:
            # mlx keeps per-thread streams; destroy them before the thread ends, or the
            # process may abort at exit ("terminate called without an active exception")
            mx.synchronize()
            mx.clear_streams()

    def _loop(self) -> None:
        active: list[GenerationTask] = []
        stopping = False
        while True:
            try:
                item = self._inbox.get(block=not active)
                while True:
                    if item is None:
                        stopping = True
                    else:
                        active.append(item[0])
                    item = self._inbox.get_nowait()
            except queue.Empty:
                pass
            if stopping:
                for task in active:
                    task.cancel()
                    task.step()
                return
            for task in list(active):
                if task.step():
                    active.remove(task)


def _stop_thread(inbox: queue.Queue[Any], thread: threading.Thread) -> None:
    inbox.put(None)
    if thread.is_alive() and thread is not threading.current_thread():
        thread.join(timeout=60)


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RequestError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise RequestError(f"message {i} must be a mapping with a string 'role'")


def _replace(req: GenerationRequest, **changes: Any) -> GenerationRequest:
    import dataclasses

    return dataclasses.replace(req, **changes)


def _build_cache(cache_config: CacheConfig, ssd_config: SSDConfig | None,
                 redis_config: RedisConfig | None = None) -> Any:
    """PromptCache over RAM, plus the SSD tier and the Redis tier when configured."""
    from ..cache import PromptCache

    lower: list[Any] = []
    if ssd_config is not None:
        from ..tiers.ssd import SSDTier

        lower.append(SSDTier(ssd_config))
    if redis_config is not None:
        from ..tiers.redis import RedisTier

        lower.append(RedisTier(redis_config))
    # each tier's own ``policy`` decides too: the Redis tier is write-through by default
    write_through = ssd_config is not None and ssd_config.policy == "write_through"
    return PromptCache(cache_config, adapter=MLXPayloadAdapter(), lower=lower,
                       write_through=write_through)
