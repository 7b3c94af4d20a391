"""Real engines over the tiny models for the server tests of the hit-rate work: a
PromptCache built here (so a test controls its clock and budget) handed to the Engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from promptcache.cache import PromptCache
from promptcache.config import CacheConfig
from promptcache.engine.engine import Engine
from promptcache.engine.models.loader import load_model
from promptcache.engine.payload.payload import MLXPayloadAdapter
from promptcache.serving_config import EngineConfig


class Clock:
    """A controllable clock for the cache (TTL, protection expiry)."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def make_cache(block_size: int = 8, budget: int = 64 * 1024**2, *,
               ttl_seconds: float | None = None, clock: Clock | None = None,
               protect_share: float = 0.25, active_session_s: float | None = 600.0,
               **kw: Any) -> PromptCache:
    cfg = CacheConfig(block_size=block_size, ram_budget_bytes=budget, ttl_seconds=ttl_seconds,
                      protect_share=protect_share, active_session_s=active_session_s)
    return PromptCache(cfg, adapter=MLXPayloadAdapter(), clock=clock or Clock(), **kw)


def tiny_engine(path: Path, cache: PromptCache | None, *, block_size: int = 8,
                chunk: int = 16, snapshot_every_blocks: int = 1, **engine_cfg: Any) -> Engine:
    model, tokenizer, info = load_model(path)
    cfg = info.config
    engine_cfg.setdefault("restore_plan", "load")  # the planner pinned: no timing in tests
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    return Engine(model, tokenizer, model_id=info.model_id, fingerprint=info.fingerprint,
                  context_length=info.context_length, vocab_size=int(vocab or 2**32),
                  engine_config=EngineConfig(prefill_chunk_tokens=chunk,
                                             snapshot_every_blocks=snapshot_every_blocks,
                                             max_tokens_limit=4096, default_max_tokens=8,
                                             **engine_cfg),
                  cache_config=CacheConfig(block_size=block_size),
                  cache=cache)
