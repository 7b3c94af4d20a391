"""The physical floor of a turn: prefill only its new tokens on a warm KV cache.

The mlx half of ``floor``: an ideal prompt cache could not do better than this in the
same process.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from promptcache.engine.models.loader import load_model


class PrefillTimer:
    """Loads a model once and prefills token runs into plain mlx-lm caches."""

    def __init__(self, model_path: str, *, prefill_step: int = 2048) -> None:
        if prefill_step <= 0:
            raise ValueError(f"prefill_step must be > 0, got {prefill_step}")
        self.model, self.tokenizer, self.info = load_model(model_path)
        self.prefill_step = prefill_step

    def new_cache(self) -> list[Any]:
        return list(make_prompt_cache(self.model))

    @staticmethod
    def trim(cache: list[Any], num_tokens: int) -> None:
        """Drop the last ``num_tokens`` tokens (full-attention caches only)."""
        trim_prompt_cache(cache, num_tokens)

    def run(self, tokens: list[int], cache: list[Any], sample: bool) -> None:
        """Prefill ``tokens`` (in ``prefill_step`` chunks, like mlx-lm's generate_step);
        ``sample``: also take the first token, as a server must before it answers."""
        if not tokens:
            raise ValueError("nothing to prefill")
        step = self.prefill_step
        i = 0
        while len(tokens) - i > step:
            self.model(mx.array(tokens[i : i + step])[None], cache=cache)
            mx.eval([c.state for c in cache])
            i += step
        logits = self.model(mx.array(tokens[i:])[None], cache=cache)
        if sample:
            mx.eval(mx.argmax(logits[:, -1, :], axis=-1))
        else:
            mx.eval([c.state for c in cache])
