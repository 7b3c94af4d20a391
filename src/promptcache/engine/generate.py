"""The prefill/decode loop of one request, with the three cache save points.

A ``GenerationTask`` is a small state machine the engine thread advances one
unit of work per ``step()``: lookup + restore, one prefill chunk, or one decode
step. That is what lets the scheduler interleave requests.

    lookup (cache.acquire) -> restore -> release
    -> chunked prefill; chunk ends at absolute multiples of the chunk size
       (a multiple of the block size), so every save lands on a block boundary
       -> after each completed chunk: store (save point 1, "mid_prefill")
    -> end of prompt: store incl. the partial tail (save point 2, "end_prefill")
    -> decode (sampling, stop strings/ids, eos), streaming TokenEvents;
       sliding-window models store output blocks as they complete
    -> end: store prompt + output[:-1], the tokens whose KV is in the cache
       (save point 3, "end_generation")

Any exception from the cache is logged and counted and turns into a miss (or a
skipped save): it never fails the request.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..config import EngineConfig
from ..errors import ContextLengthError, RequestError
from ..hashing import validate_tokens
from ..meta import Namespace
from . import adapters
from .api import GenerationRequest, GenerationResult, SamplingParams, TokenEvent, Usage
from .sampling import Detokenizer, Sampler, StopStrings

logger = logging.getLogger(__name__)

Event = TokenEvent | GenerationResult
LogitsHook = Callable[[str, int, np.ndarray], None]


@dataclass
class EngineCounters:
    """Counters shared by the tasks of one engine (read by stats endpoints)."""

    requests: int = 0
    cache_errors: int = 0
    restore_errors: int = 0
    store_errors: int = 0
    cancelled: int = 0
    errors: int = 0

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class GenContext:
    """What every request of one engine shares: the model and the cache."""

    model: Any
    tokenizer: Any
    config: EngineConfig
    context_length: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    cache: Any | None = None  # PromptCache
    namespace_for: Callable[[str], Namespace] | None = None
    block_size: int = 64
    counters: EngineCounters = field(default_factory=EngineCounters)
    logits_hook: LogitsHook | None = None


def validate_request(req: GenerationRequest, ctx: GenContext) -> tuple[int, ...]:
    """Check a request before anything runs or is stored; raise ``RequestError``."""
    if not isinstance(req, GenerationRequest):
        raise RequestError(f"expected a GenerationRequest, got {type(req).__name__}")
    sp = req.sampling
    if not isinstance(sp, SamplingParams):
        raise RequestError(f"sampling must be SamplingParams, got {type(sp).__name__}")
    try:
        tokens = validate_tokens(req.prompt_tokens)
    except ValueError as e:
        raise RequestError(f"invalid prompt: {e}") from None
    bad = [t for t in tokens if t >= ctx.vocab_size]
    if bad:
        raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (size {ctx.vocab_size})")
    if not isinstance(sp.stop, (tuple, list)) or not all(isinstance(s, str) and s for s in sp.stop):
        raise RequestError(f"stop must be a sequence of non-empty strings, got {sp.stop!r}")
    if not isinstance(sp.stop_token_ids, (tuple, list)) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in sp.stop_token_ids
    ):
        raise RequestError(f"stop_token_ids must be a sequence of token ids, got {sp.stop_token_ids!r}")
    if isinstance(sp.max_tokens, bool) or not isinstance(sp.max_tokens, int) or sp.max_tokens <= 0:
        raise RequestError(f"max_tokens must be a positive integer, got {sp.max_tokens!r}")
    # seam fields the batched scheduler implements (issue 11); refused until then
    if req.constraint is not None:
        raise RequestError("constrained decoding is not supported by this engine yet")
    if sp.logprobs is not None:
        raise RequestError("logprobs are not supported by this engine yet")
    if sp.top_k:
        raise RequestError("top_k is not supported by this engine yet")
    if req.prefill_only or req.priority != "interactive":
        raise RequestError("background / prefill-only requests are not supported yet")
    if sp.max_tokens > ctx.config.max_tokens_limit:
        raise RequestError(f"max_tokens {sp.max_tokens} exceeds the limit {ctx.config.max_tokens_limit}")
    if len(tokens) + sp.max_tokens > ctx.context_length:
        raise ContextLengthError(
            f"prompt ({len(tokens)} tokens) + max_tokens ({sp.max_tokens}) exceeds the "
            f"model's context length ({ctx.context_length})"
        )
    return tokens


class GenerationTask:
    """One request's generation, advanced by ``step()`` on the engine thread."""

    def __init__(
        self,
        ctx: GenContext,
        request: GenerationRequest,
        emit: Callable[[Event], None],
        *,
        prompt_tokens: Sequence[int] | None = None,
    ) -> None:
        self.ctx = ctx
        self.req = request
        self.prompt = list(prompt_tokens if prompt_tokens is not None else validate_request(request, ctx))
        self.emit = emit
        self.sampler = Sampler(request.sampling)
        self.detok = Detokenizer(ctx.tokenizer)
        self.stops = StopStrings(request.sampling.stop)
        self.stop_ids = frozenset(request.sampling.stop_token_ids) | ctx.eos_token_ids
        self.usage = Usage(prompt_tokens=len(self.prompt))
        self.result: GenerationResult | None = None
        self.output: list[int] = []
        self.caches: list[Any] = []
        self.pos = 0  # tokens whose state is in self.caches
        self.phase = "start"
        self._cancel = False
        self._t0 = time.perf_counter()
        self._t_first: float | None = None
        self._timings = {"lookup_s": 0.0, "restore_s": 0.0, "prefill_s": 0.0}
        self._miss_reason: str | None = None
        self._logits: mx.array | None = None
        self._last_snapshot = 0
        self.use_cache = bool(request.use_cache and ctx.cache is not None and ctx.namespace_for)
        self.ns: Namespace | None = ctx.namespace_for(request.tenant) if self.use_cache and ctx.namespace_for else None
        self.truncatable = True
        self.sliding = False

    # ------------------------------------------------------------------ control

    @property
    def done(self) -> bool:
        return self.result is not None

    def cancel(self) -> None:
        """Thread-safe: the next ``step()`` finishes the request as "cancelled"."""
        self._cancel = True

    def run(self) -> GenerationResult:
        """Run to completion (single-request use and tests)."""
        while not self.step():
            pass
        if self.result is None:  # pragma: no cover - step() returned True without a result
            raise RuntimeError("generation finished without a result")
        return self.result

    def step(self) -> bool:
        """Advance by one unit of work; True once the result has been emitted."""
        if self.result is not None:
            return True
        try:
            if self._cancel:
                self._finish("cancelled")
            elif self.phase == "start":
                self._start()
            elif self.phase == "prefill":
                self._prefill_chunk()
            else:
                self._decode_step()
        except Exception as e:  # a model/runtime failure ends this request only
            logger.exception("request %s failed", self.req.request_id or "?")
            self.ctx.counters.errors += 1
            self._finish("error", error=f"{type(e).__name__}: {e}", store=False)
        return self.result is not None

    # ------------------------------------------------------------------ phases

    def _start(self) -> None:
        self.ctx.counters.requests += 1
        template = make_prompt_cache(self.ctx.model)
        self.truncatable = adapters.is_truncatable(template)
        self.sliding = adapters.has_sliding_window(template)
        self.caches = template
        if self.use_cache:
            self._lookup_and_restore()
        self._last_snapshot = self.pos
        self.phase = "prefill"

    def _lookup_and_restore(self) -> None:
        cache, ns = self.ctx.cache, self.ns
        spans = self.req.extra_keys
        t = time.perf_counter()
        try:
            hit = cache.acquire(self.prompt, ns, extra_keys=spans, session_id=self.req.session_id)
        except Exception:
            logger.exception("cache lookup failed; prefilling the whole prompt")
            self.ctx.counters.cache_errors += 1
            self._timings["lookup_s"] = time.perf_counter() - t
            return
        self._timings["lookup_s"] = time.perf_counter() - t
        t = time.perf_counter()
        try:
            miss = getattr(hit, "miss", None)
            if miss is not None:
                self._miss_reason = describe_miss(miss, self.req.message_starts)
            n = int(hit.num_tokens)
            if n >= len(self.prompt):  # an exact hit must still re-run the last token
                n = len(self.prompt) - 1
            if n > 0:
                self.caches = adapters.restore(
                    self.ctx.model, hit.blocks, n, reserve=len(self.prompt) - n + 1
                )
                self.pos = n
                self.usage.cached_tokens = n
                self.usage.cached_by_tier = _cut_by_tier(hit.tokens_by_tier, n)
        except Exception:
            logger.exception("restoring cached blocks failed; prefilling the whole prompt")
            self.ctx.counters.restore_errors += 1
            self.caches = make_prompt_cache(self.ctx.model)
            self.pos = 0
            self.usage.cached_tokens = 0
            self.usage.cached_by_tier = {}
        finally:
            try:
                cache.release(hit)
            except Exception:
                logger.exception("cache release failed")
                self.ctx.counters.cache_errors += 1
            self._timings["restore_s"] = time.perf_counter() - t

    def _prefill_chunk(self) -> None:
        t = time.perf_counter()
        n = len(self.prompt)
        chunk = self.ctx.config.prefill_chunk_tokens
        end = min(n, (self.pos // chunk + 1) * chunk)
        logits = self.ctx.model(mx.array(self.prompt[self.pos : end])[None], cache=self.caches)
        self._logits = logits[0, -1]
        mx.eval(self._logits, *[a for _, a in adapters.state_arrays(self.caches)])
        self.pos = end
        self._timings["prefill_s"] += time.perf_counter() - t
        if end < n:
            self._save_mid_prefill()
            return
        self.phase = "decode"
        # the first token goes out before the end-of-prefill save: saving is not in TTFT
        reason = self._sample_and_emit(finish=False)
        self._store(self.prompt, n, "end_prefill", include_partial=True, snapshot_at_end=True)
        if reason is not None:
            self._finish(reason)

    def _decode_step(self) -> None:
        last = self.output[-1]
        logits = self.ctx.model(mx.array([[last]]), cache=self.caches)
        self._logits = logits[0, -1]
        mx.eval(self._logits, *[a for _, a in adapters.state_arrays(self.caches)])
        self.pos += 1
        if self.sliding and self.pos % self.ctx.block_size == 0:
            # a sliding window drops old tokens: store output blocks while they are in it
            self._store(self._sequence(), self.pos, "end_generation", include_partial=False,
                        snapshot_at_end=False)
        self._sample_and_emit()

    # ------------------------------------------------------------------ helpers

    def _sample_and_emit(self, finish: bool = True) -> str | None:
        """Sample, emit one TokenEvent; return the finish reason (and finish if asked)."""
        logits = self._logits
        if logits is None:  # pragma: no cover - prefill always sets it
            raise RuntimeError("no logits to sample from")
        if self.ctx.logits_hook is not None:
            self.ctx.logits_hook(self.req.request_id, len(self.output), np.array(logits.astype(mx.float32)))
        tok = self.sampler(logits)
        now = time.perf_counter()
        if self._t_first is None:
            self._t_first = now
        self.output.append(tok)
        reason: str | None = None
        if tok in self.stop_ids:
            reason, text = "stop", self._flush_text()
        else:
            text = self.stops.feed(self.detok.add(tok))
            if self.stops.stopped:
                reason = "stop"
            elif len(self.output) >= self.req.sampling.max_tokens:
                reason, text = "length", text + self._flush_text()
        # one TokenEvent per output token; the last one carries any held-back text
        self.emit(TokenEvent(token_id=tok, text=text))
        if reason is not None and finish:
            self._finish(reason)
        return reason

    def _flush_text(self) -> str:
        text = self.stops.feed(self.detok.flush())
        return text if self.stops.stopped else text + self.stops.flush()

    def _sequence(self) -> list[int]:
        """The tokens whose state is in the caches: prompt + output[:pos - len(prompt)]."""
        return self.prompt + self.output[: self.pos - len(self.prompt)]

    def _save_mid_prefill(self) -> None:
        snap = True
        if not self.truncatable:
            every = self.ctx.config.snapshot_every_blocks * self.ctx.block_size
            snap = self.pos // every > self._last_snapshot // every
        self._store(self.prompt, self.pos, "mid_prefill", include_partial=False, snapshot_at_end=snap)
        if snap:
            self._last_snapshot = self.pos

    def _store(
        self, tokens: Sequence[int], num_tokens: int, save_point: str, *,
        include_partial: bool, snapshot_at_end: bool,
    ) -> None:
        if not self.use_cache or num_tokens <= 0:
            return
        caches = self.caches

        def payload_for(start: int, end: int, snapshot: bool) -> dict[str, mx.array]:
            return adapters.extract_block(caches, start, end, snapshot)

        try:
            created = self.ctx.cache.store(
                self.ns, list(tokens), num_tokens, payload_for,
                extra_keys=self.req.extra_keys, session_id=self.req.session_id,
                truncatable=self.truncatable, snapshot_at_end=snapshot_at_end,
                include_partial=include_partial, save_point=save_point,
            )
        except Exception:
            logger.exception("storing blocks (%s) failed; continuing without saving", save_point)
            self.ctx.counters.store_errors += 1
            return
        attr = f"saved_{save_point}"
        setattr(self.usage, attr, getattr(self.usage, attr) + int(created))

    def _finish(self, reason: str, *, error: str | None = None, store: bool = True) -> None:
        end = time.perf_counter()
        if reason == "cancelled":
            self.ctx.counters.cancelled += 1
        if store and self.phase == "decode" and self.output:
            self._store(self._sequence(), self.pos, "end_generation", include_partial=True,
                        snapshot_at_end=True)
        self.usage.completion_tokens = len(self.output)
        t_first = self._t_first if self._t_first is not None else end
        self.result = GenerationResult(
            tokens=list(self.output),
            text=self.stops.text,
            finish_reason=reason,
            usage=self.usage,
            ttft_s=(t_first - self._t0) if self._t_first is not None else 0.0,
            prefill_s=self._timings["prefill_s"],
            decode_s=(end - self._t_first) if self._t_first is not None else 0.0,
            lookup_s=self._timings["lookup_s"],
            restore_s=self._timings["restore_s"],
            miss_reason=self._miss_reason,
            error=error,
            stop_sequence=self.stops.matched if reason == "stop" else None,
        )
        self.caches = []
        self._logits = None
        self.emit(self.result)


def _cut_by_tier(by_tier: Any, n: int) -> dict[str, int]:
    """Per-tier cached token counts, trimmed to the ``n`` tokens actually restored."""
    out: dict[str, int] = {}
    left = n
    for tier, count in dict(by_tier or {}).items():
        take = min(int(count), left)
        if take > 0:
            out[str(tier)] = take
        left -= take
    return out


def describe_miss(miss: Any, message_starts: Sequence[int] = ()) -> str:
    """One line saying why a lookup stopped short: cause, first divergent token, message."""
    cause = getattr(miss, "cause", None)
    position = getattr(miss, "position", None)
    if cause is None or position is None:
        return str(miss)
    text = f"{cause}: first uncached token at position {position}"
    if message_starts:
        idx = bisect.bisect_right(list(message_starts), int(position)) - 1
        if idx >= 0:
            text += f" (chat message {idx})"
    restorable = getattr(miss, "restorable", None)
    if restorable is not None and restorable != position:
        text += f"; state restorable at {restorable}"
    return text
