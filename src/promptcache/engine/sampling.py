"""Sampling with a per-request PRNG key (batched rows never disturb each other; seeds reproduce),
streaming detokenization, and stop strings scanned on the new tail only."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p
from mlx_lm.tokenizer_utils import StreamingDetokenizer

from .api import SamplingParams


class Sampler:
    """One request's token choice from the logits of its last position."""

    def __init__(self, params: SamplingParams) -> None:
        self.temperature = float(params.temperature)
        self.top_p = float(params.top_p)
        self.top_k = int(params.top_k)
        self.num_logprobs = params.logprobs
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0 or seed >= 2**64:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
        self._key = mx.random.key(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def wants_logprobs(self) -> bool:
        return self.num_logprobs is not None

    def sample(self, logits: mx.array) -> mx.array:
        """The sampled token id (a lazy 0-d uint32 array) from ``[vocab]`` logits."""
        if self.greedy:
            return mx.argmax(logits, axis=-1)
        logprobs = logits.astype(mx.float32)
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        if 0 < self.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, self.top_k)
        if 0.0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        self._key, sub = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1.0 / self.temperature), key=sub)

    def __call__(self, logits: mx.array) -> int:
        """Sample and evaluate (single-request use)."""
        return int(cast(int, self.sample(logits).item()))

    def logprob_arrays(self, logits: mx.array, token: mx.array) -> tuple[mx.array, ...]:
        """Lazy ``(logprob of token, top ids, top logprobs)`` for ``logprobs=k`` (k may be 0)."""
        lp = logits.astype(mx.float32)
        lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
        chosen = lp[token]
        k = int(self.num_logprobs or 0)
        if k <= 0:
            return (chosen,)
        top = mx.argpartition(-lp, kth=k - 1, axis=-1)[:k]
        vals = lp[top]
        order = mx.argsort(-vals)
        return chosen, top[order], vals[order]


def logprob_values(arrays: Sequence[mx.array]) -> tuple[float, tuple[tuple[int, float], ...]]:
    """Host values of ``Sampler.logprob_arrays`` (evaluated)."""
    chosen = float(cast(float, arrays[0].item()))
    if len(arrays) == 1:
        return chosen, ()
    ids = cast(list[int], arrays[1].tolist())
    vals = cast(list[float], arrays[2].tolist())
    return chosen, tuple((int(i), float(v)) for i, v in zip(ids, vals, strict=True))


class Detokenizer:
    """Incremental text from token ids, never a partial UTF-8 character."""

    def __init__(self, tokenizer: Any) -> None:
        stream: Any = None
        try:
            stream = getattr(tokenizer, "detokenizer", None)
        except Exception:  # a tokenizer without a streaming detokenizer
            stream = None
        self._stream: StreamingDetokenizer | None = (
            stream if isinstance(stream, StreamingDetokenizer) else None)
        self._tok = tokenizer
        self.tokens: list[int] = []
        self._prefix = 0
        self._read = 0
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids)))

    def add(self, token_id: int) -> str:
        if self._stream is not None:
            self._stream.add_token(token_id)
            delta = str(self._stream.last_segment)
            if delta:
                self._parts.append(delta)
            return delta
        self.tokens.append(token_id)
        before = self._decode(self.tokens[self._prefix : self._read])
        now = self._decode(self.tokens[self._prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            delta = now[len(before) :]
            self._prefix, self._read = self._read, len(self.tokens)
            self._parts.append(delta)
            return delta
        return ""

    def flush(self) -> str:
        if self._stream is not None:
            self._stream.finalize()
            delta = str(self._stream.last_segment)
        else:
            before = self._decode(self.tokens[self._prefix : self._read])
            now = self._decode(self.tokens[self._prefix :])
            delta = now[len(before) :] if len(now) > len(before) else ""
            self._prefix = self._read = len(self.tokens)
        if delta:
            self._parts.append(delta)
        return delta


class StopStrings:
    """Finds stop strings in streamed text (earliest wins), holding back a partial match."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._longest = max((len(s) for s in self.stops), default=0)
        self._parts: list[str] = []
        self._len = 0  # characters fed (before any cut)
        self._tail = ""  # the last (longest - 1) characters fed
        self._cut: int | None = None
        self.emitted = 0
        self.stopped = False
        self.matched: str | None = None

    @property
    def text(self) -> str:
        """The text so far, cut before the stop string once one matched."""
        full = "".join(self._parts)
        return full if self._cut is None else full[: self._cut]

    def feed(self, delta: str) -> str:
        """Append ``delta``; return the text that is safe to emit now."""
        if self.stopped or not delta:
            return ""
        self._parts.append(delta)
        if not self.stops:
            self._len += len(delta)
            self.emitted = self._len
            return delta
        window = self._tail + delta
        base = self._len - len(self._tail)  # absolute position of window[0]
        self._len += len(delta)
        keep = self._longest - 1
        self._tail = window[-keep:] if keep > 0 else ""
        found = self._scan(window)
        if found:
            at, which = min(found)
            self.stopped = True
            self.matched = self.stops[which]
            self._cut = base + at
            out = window[self.emitted - base : at] if self._cut > self.emitted else ""
            self.emitted = max(self.emitted, self._cut)
            return out
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(window)), 0, -1):
                if window.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        safe = self._len - hold
        if safe <= self.emitted:
            return ""
        out = window[self.emitted - base : safe - base]
        self.emitted = safe
        return out

    def _scan(self, window: str) -> list[tuple[int, int]]:
        """``(position, stop index)`` of each stop string found in ``window``."""
        return [(i, k) for k, i in enumerate(window.find(s) for s in self.stops) if i >= 0]

    def flush(self) -> str:
        """Release the held-back text (generation ended without a match)."""
        if self.stopped or self.emitted >= self._len:
            return ""
        held = self._len - self.emitted
        out = self._tail[-held:] if held <= len(self._tail) else self.text[self.emitted :]
        self.emitted = self._len
        return out
