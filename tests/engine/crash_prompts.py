"""Prompts and configs shared by the engine crash test and its child process."""

from __future__ import annotations

import numpy as np

from promptcache.config import CacheConfig
from promptcache.serving_config import EngineConfig

ENGINE_CONFIG = EngineConfig(prefill_chunk_tokens=16)
CACHE_CONFIG = CacheConfig(block_size=8, ram_budget_bytes=64 * 1024**2)


def prompt_for(seed: int, i: int) -> list[int]:
    """Prompt ``i`` of a run: a shared head (so later prompts hit earlier blocks)
    plus a tail of its own, 40-70 tokens in all."""
    rng = np.random.default_rng(seed * 1000 + i)
    head = np.random.default_rng(seed).integers(3, 1000, size=24)
    tail = rng.integers(3, 1000, size=int(rng.integers(16, 46)))
    return [int(t) for t in np.concatenate([head, tail])]
