"""One request's state on the engine thread: start (lookup + restore, or the live state) ->
chunked prefill with its saves -> first token -> decode (``accept``: stops, max_tokens) -> the
end-of-generation save. A cache error becomes a miss or a skipped save, never a failed request;
the cache side is ``request_saves.py``."""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import TokenBuffer, make_prompt_cache

from ...cache.miss import CacheMiss
from ...cache.types import ChainCursor
from ...meta import Namespace
from .. import mlx_compat
from ..api import GenerationRequest, GenerationResult, TokenEvent, Usage
from ..context import EngineContext, Processor, store_error_cause, validate_request
from ..models.vision import ImagePrefill
from ..payload import adapters
from ..sampling import Detokenizer, Sampler, StopStrings, logprob_values
from .handles import Event
from .request_saves import keep_live, lookup_and_restore, save_mid_prefill, store
from .row import Splice
from .splice import splice_due

logger = logging.getLogger(__name__)

# the context names stay importable from here (they lived here before context.py)
__all__ = ["EngineContext", "Processor", "Request", "store_error_cause", "validate_request"]


class Request:
    """One request, advanced by the scheduler (prefill chunks) and a decoder (tokens)."""

    def __init__(self, ctx: EngineContext, request: GenerationRequest, prompt: np.ndarray,
                 emit: Callable[[Event], None], *, cancelled: Callable[[], bool] | None = None,
                 processors: Sequence[Processor] = (), queue_s: float = 0.0,
                 t_submit: float | None = None) -> None:
        self.ctx = ctx
        self.req = request
        self.emit = emit
        self._cancelled = cancelled
        self.n_prompt = int(prompt.shape[0])
        sp = request.sampling
        # the token sequence: prompt, then output as it is generated (never reallocated)
        self.seq = np.empty(self.n_prompt + (0 if request.prefill_only else sp.max_tokens) + 1,
                            dtype=np.uint32)
        self.seq[: self.n_prompt] = prompt
        self.output: list[int] = []
        self.sampler = Sampler(sp)
        self.detok = Detokenizer(ctx.tokenizer)
        self.stops = StopStrings(sp.stop)
        self.stop_ids = frozenset(sp.stop_token_ids) | ctx.eos_token_ids
        # logits processors (a constraint: engine/formats/constrained.py), built at submit
        self.processors: list[Processor] = list(processors)
        self._context: TokenBuffer | None = None
        self.usage = Usage(prompt_tokens=self.n_prompt)
        self.result: GenerationResult | None = None
        self.caches: list[Any] = []  # private caches (prefill, or decoding alone)
        self.pos = 0  # tokens whose state is in the caches (private or a batch row)
        self.splice: Splice | None = None  # a tail read while the head prefills (splice.py)
        self.phase = "new"  # new -> prefill -> decode -> done
        self._t0 = t_submit if t_submit is not None else time.perf_counter()
        self.queue_s = queue_s
        self._t_first: float | None = None
        self.timings = {"lookup_s": 0.0, "restore_s": 0.0, "prefill_s": 0.0}
        self.miss: CacheMiss | None = None
        # called once, just before the final result is emitted (the scheduler releases
        # the admission ticket there, so a client holding its answer is never counted)
        self.on_finish: Callable[[], None] | None = None
        self.last_snapshot = 0
        # non-truncatable states: the message starts inside the prompt, where prefill
        # stops for a state snapshot (set at start)
        self.snap_at: tuple[int, ...] = ()
        self.waited_for_prefix = False  # counted once (scheduler: shared prefixes)
        self.use_cache = bool(request.use_cache and ctx.cache is not None and ctx.namespace_for)
        self.ns: Namespace | None = (
            ctx.namespace_for(request.tenant) if self.use_cache and ctx.namespace_for else None)
        self.cursor: ChainCursor | None = ChainCursor(self.ns) if self.ns is not None else None
        self.truncatable = True
        self.sliding = False
        # image digests join the extra keys of every block over their placeholders
        self.extra_keys = request.cache_extra_keys()
        self.images = (ImagePrefill(ctx.vision, request.images)
                       if request.images and ctx.vision is not None else None)


    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def background(self) -> bool:
        return self.req.priority == "background"

    @property
    def cancelled(self) -> bool:
        return self._cancelled is not None and self._cancelled()

    def sequence(self, num_tokens: int) -> np.ndarray:
        """The first ``num_tokens`` of prompt + output (a view, nothing copied)."""
        return self.seq[:num_tokens]

    @property
    def prefill_done(self) -> bool:
        return self.pos >= self.n_prompt


    def start(self) -> None:
        """Lookup + restore (the request's private caches start at ``self.pos``)."""
        self.ctx.counters.requests += 1
        template = make_prompt_cache(self.ctx.model)
        self.truncatable = adapters.is_truncatable(template)
        self.sliding = adapters.has_sliding_window(template)
        self.caches = list(template)
        if self.use_cache:
            lookup_and_restore(self)
            keep = self.ctx.config.message_snapshots
            if not self.truncatable and keep:
                starts = sorted({int(m) for m in self.req.message_starts
                                 if self.pos < m < self.n_prompt})
                self.snap_at = tuple(starts[-keep:])
        self.last_snapshot = self.pos
        self.phase = "prefill"


    def chunk_end(self) -> int:
        """Where this request's next chunk ends: the next multiple of the chunk size (so
        mid-prefill saves land on block boundaries) or the prompt's end; for a state that
        cannot be truncated, the next message start before that (a snapshot is stored
        there). Plain KV takes no sliver: a rest that fits in one chunk plus its last token
        is one chunk, and a chunk under half a chunk long ends at the multiple after."""
        chunk = self.ctx.config.prefill_chunk_tokens
        end = (self.pos // chunk + 1) * chunk
        if self.truncatable and not self.sliding:
            if self.n_prompt - self.pos <= chunk + 1:  # its last token goes alone anyway
                end = self.n_prompt
            elif end - self.pos < chunk // 2:
                end += chunk
        end = min(self.n_prompt, end)
        if self.snap_at:
            i = bisect.bisect_right(self.snap_at, self.pos)
            if i < len(self.snap_at) and self.snap_at[i] < end:
                end = self.snap_at[i]
        return end if self.splice is None else self.splice.cap(end, self.pos)

    def prefill_chunk(self) -> bool:
        """Run one chunk on the private caches; True once the prompt is done (then the
        first token was emitted, or the request finished)."""
        splice_due(self)
        t, p0 = time.perf_counter(), self.pos
        n = self.n_prompt
        end = self.chunk_end()
        split = end >= n and end - self.pos > 1 and self.images is None
        # the prompt's last chunk runs as chunk[:-1] + its last token, so that the lm
        # head runs for one position instead of every position of the chunk
        first = end - 1 if split else end
        self.save_before_slide(self.pos, first - self.pos)
        logits = self._forward(self.pos, first)
        states = [a for _, a in adapters.state_arrays(self.caches)]
        if split:
            mx.eval(*states)
            # one token slides a window: the blocks it would push out are stored first
            self.save_before_slide(first, 1)
            logits = self._forward(first, end)
            states = [a for _, a in adapters.state_arrays(self.caches)]
        last = logits[0, -1]
        # a mid-prompt chunk needs only the cache state: its logits are never evaluated
        if end >= n:
            mx.eval(last, *states)
        else:
            mx.eval(*states)
        self.prefill_s += self.ctx.timed_prefill([(p0, end - p0)], time.perf_counter() - t)
        if not self.chunk_done(end):
            return False
        splice_due(self)  # a tail still unread is given up (and timed)
        self.end_prefill(self.first_token(last))
        return True

    def _forward(self, start: int, end: int) -> mx.array:
        """Tokens ``[start, end)`` through the model on the private caches (lazy)."""
        inputs = mx.array(self.seq[start:end])[None]
        if self.images is not None:
            return self.images.forward(self.ctx.model, inputs, self.caches, start, end)
        return self.ctx.model(inputs, cache=self.caches)

    @property
    def prefill_s(self) -> float:
        return self.timings["prefill_s"]

    @prefill_s.setter
    def prefill_s(self, v: float) -> None:
        self.timings["prefill_s"] = v

    def chunk_done(self, end: int, caches: Sequence[Any] | None = None) -> bool:
        """A chunk's forward ran: the caches (``caches``, default the private ones) hold
        ``end`` tokens. Before the prompt's end: the mid-prefill save; returns True at
        the prompt's end."""
        self.pos = end
        self.ctx.counters.prefill_chunks += 1
        if end < self.n_prompt:
            save_mid_prefill(self, caches)
            return False
        return True

    def first_token(self, last: mx.array) -> str | None:
        """The prompt is in the caches: sample and emit the first token from ``last``
        (``[vocab]`` logits of the prompt's last position); the finish reason if the
        request ends here ("prefilled" for a prefill-only request)."""
        if self.req.prefill_only:
            return "prefilled"
        self.phase = "decode"
        tok, lp = self.sample_now(last)
        return self.accept(tok, lp, last)

    def end_prefill(self, reason: str | None, caches: Sequence[Any] | None = None) -> None:
        """The end-of-prefill save (after the first token went out: saving is not in
        TTFT), from ``caches`` (default the private ones); finish if ``reason``."""
        n = self.n_prompt
        store(self, n, "end_prefill", include_partial=True, snapshot_at_end=True, caches=caches)
        if reason == "prefilled":
            self.ctx.counters.prefilled += 1
            self.finish("prefilled", caches)
        elif reason is not None:
            self.finish(reason, self.caches if caches is None else caches)

    def save_before_slide(self, held: int, n_new: int, caches: Sequence[Any] | None = None,
                          save_point: str = "mid_prefill") -> None:
        """Sliding windows: the caches (``caches``, default the private ones) hold
        ``held`` tokens; before a forward of ``n_new`` more, store the whole blocks not
        stored yet whose tokens that forward would push out of a window (a block is
        saved while its tokens are still in the window)."""
        if not self.slide_save_due(held) or self.cursor is None:
            return
        src = self.caches if caches is None else caches
        if mlx_compat.window_floor_after(src, n_new) > self.cursor.start:
            store(self, held, save_point, include_partial=False, snapshot_at_end=False,
                  caches=src)

    def slide_save_due(self, held: int) -> bool:
        """Whether ``save_before_slide`` may store anything when the caches hold ``held``
        tokens: a sliding-window request with a whole block not stored yet (a partial
        one stays: block <= window). A cheap check before reading a batch row."""
        if not self.sliding or not self.use_cache or self.cursor is None:
            return False
        return held - self.cursor.start >= self.ctx.block_size


    def process(self, logits: mx.array, fed: mx.array | None) -> mx.array:
        """Apply the request's logits processors (a constraint) to ``[vocab]`` logits.
        They see every token so far (mlx-lm's convention): the prompt, then ``fed``,
        the token(s) fed to the model since the last call (lazy arrays are fine)."""
        if not self.processors:
            return logits
        if self._context is None:
            self._context = TokenBuffer(self.seq[: self.n_prompt].tolist())
        context = self._context.update_and_fetch(fed) if fed is not None else self._context.tokens
        out = logits[None]
        for proc in self.processors:
            out = proc(context, out)
        return out[0]

    def sample_now(self, logits: mx.array, fed: mx.array | None = None
                   ) -> tuple[int, tuple[float, tuple[tuple[int, float], ...]] | None]:
        """Sample one token from ``[vocab]`` logits and evaluate it (prefill, alone)."""
        logits = self.process(logits, fed)
        tok = self.sampler.sample(logits)
        if self.sampler.wants_logprobs:
            arrays = self.sampler.logprob_arrays(logits, tok)
            mx.eval(tok, *arrays)
            return int(cast(int, tok.item())), logprob_values(arrays)
        return int(cast(int, tok.item())), None

    def accept(self, tok: int, lp: tuple[float, tuple[tuple[int, float], ...]] | None,
               logits: mx.array | None = None) -> str | None:
        """One generated token: emit it; return the finish reason, if it ends here."""
        if self.ctx.logits_hook is not None and logits is not None:
            self.ctx.logits_hook(self.request_id, len(self.output),
                                 np.array(logits.astype(mx.float32)))
        if self._t_first is None:
            self._t_first = time.perf_counter()
        self.seq[self.n_prompt + len(self.output)] = tok
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
        if lp is None:
            self.emit(TokenEvent(token_id=tok, text=text))
        else:
            self.emit(TokenEvent(token_id=tok, text=text, logprob=lp[0], top_logprobs=lp[1]))
        return reason

    def _flush_text(self) -> str:
        text = self.stops.feed(self.detok.flush())
        return text if self.stops.stopped else text + self.stops.flush()


    def store_decoded_block(self, caches: Sequence[Any]) -> None:
        """Sliding-window models: store the output block that just completed (its
        tokens leave the window soon)."""
        store(self, self.pos, "end_generation", include_partial=False, snapshot_at_end=False,
              caches=caches)


    def finish(self, reason: str, caches: Sequence[Any] | None = None, *,
               state_pos: int | None = None, error: str | None = None) -> None:
        """End the request: the end-of-generation save from ``caches`` (holding the
        state after ``state_pos`` tokens; default: prompt + output[:-1]), the result."""
        if self.result is not None:
            return
        end = time.perf_counter()
        if reason == "cancelled":
            self.ctx.counters.cancelled += 1
        if caches is not None and self.phase == "decode" and self.output:
            pos = state_pos if state_pos is not None else self.n_prompt + len(self.output) - 1
            store(self, pos, "end_generation", include_partial=True, snapshot_at_end=True,
                  caches=caches)
        if reason != "error":
            keep_live(self, reason, caches, state_pos)
        self.usage.completion_tokens = len(self.output)
        spec = self.ctx.speculator
        if spec is not None:
            spec.forget(self)
            try:  # the output drafts for the tenant's next requests
                if reason != "error":
                    spec.remember(self)
            except Exception:
                logger.exception("the draft pool failed to take a finished request")
        self.phase = "done"
        self.result = GenerationResult(
            tokens=list(self.output),
            text=self.stops.text,
            finish_reason=reason,
            usage=self.usage,
            ttft_s=(self._t_first - self._t0) if self._t_first is not None else 0.0,
            prefill_s=self.timings["prefill_s"],
            decode_s=(end - self._t_first) if self._t_first is not None else 0.0,
            lookup_s=self.timings["lookup_s"],
            restore_s=self.timings["restore_s"],
            error=error,
            stop_sequence=self.stops.matched if reason == "stop" else None,
            miss=self.miss,
            queue_s=self.queue_s,
        )
        self.caches = []
        if self.on_finish is not None:
            try:
                self.on_finish()
            except Exception:
                logger.exception("the request's finish hook failed")
        self.emit(self.result)

    def fail(self, error: str) -> None:
        """A model / runtime failure: end without saving."""
        self.ctx.counters.errors += 1
        self.finish("error", None, error=error)
