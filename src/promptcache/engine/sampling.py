"""Token sampling with a per-request PRNG key, and incremental detokenization.

Each request owns its key (``mx.random.key(seed)``, split at every step), so
interleaved requests never disturb each other's random streams and a seeded
request is reproducible whatever else the engine is doing.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from .api import SamplingParams


class Sampler:
    """Greedy when ``temperature == 0``; otherwise temperature + nucleus (top_p) sampling."""

    def __init__(self, params: SamplingParams) -> None:
        self.temperature = float(params.temperature)
        self.top_p = float(params.top_p)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0 or seed >= 2**64:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
        self._key = mx.random.key(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def __call__(self, logits: mx.array) -> int:
        """Sample one token id from the logits of the last position (shape ``[vocab]``)."""
        if self.greedy:
            return int(mx.argmax(logits, axis=-1).item())
        self._key, sub = mx.random.split(self._key)
        scaled = logits.astype(mx.float32) / self.temperature
        if self.top_p < 1.0:
            probs = mx.softmax(scaled, axis=-1)
            order = mx.argsort(-probs, axis=-1)
            sorted_probs = probs[order]
            cum = mx.cumsum(sorted_probs, axis=-1)
            # keep the smallest prefix whose mass reaches top_p (always >= 1 token)
            num_keep = mx.maximum(mx.sum((cum - sorted_probs) < self.top_p), 1)
            threshold = sorted_probs[num_keep - 1]
            keep = probs >= threshold
            scaled = mx.where(keep, scaled, mx.array(-float("inf"), dtype=scaled.dtype))
        return int(mx.random.categorical(scaled, key=sub).item())


class Detokenizer:
    """Incremental text from token ids, never emitting a partial UTF-8 character.

    Decodes a short window ``tokens[prefix:]`` each step and emits what it adds
    over ``tokens[prefix:read]``, so the work per token stays small.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.tokens: list[int] = []
        self._prefix = 0
        self._read = 0
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids)))

    def add(self, token_id: int) -> str:
        self.tokens.append(token_id)
        before = self._decode(self.tokens[self._prefix : self._read])
        now = self._decode(self.tokens[self._prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            delta = now[len(before) :]
            self._prefix, self._read = self._read, len(self.tokens)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        before = self._decode(self.tokens[self._prefix : self._read])
        now = self._decode(self.tokens[self._prefix :])
        delta = now[len(before) :] if len(now) > len(before) else ""
        self._prefix = self._read = len(self.tokens)
        self.text += delta
        return delta


class StopStrings:
    """Finds stop strings in streamed text and holds back a possible partial match."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.text = ""
        self.emitted = 0
        self.stopped = False
        # which stop string cut the text (the earliest match; ties: the first listed)
        self.matched: str | None = None

    def feed(self, delta: str) -> str:
        """Append ``delta``; return the text that is safe to emit now."""
        self.text += delta
        if not self.stops:
            out = self.text[self.emitted :]
            self.emitted = len(self.text)
            return out
        found = [(i, k) for k, i in enumerate(self.text.find(s) for s in self.stops) if i >= 0]
        if found:
            cut, which = min(found)
            self.stopped = True
            self.matched = self.stops[which]
            self.text = self.text[:cut]
            out = self.text[self.emitted :]
            self.emitted = len(self.text)
            return out
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        safe = len(self.text) - hold
        out = self.text[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return out

    def flush(self) -> str:
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out
