"""Engines over the tiny models for the generation tests (small blocks and chunks)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from promptcache.cache import PromptCache
from promptcache.config import CacheConfig
from promptcache.engine.engine import Engine
from promptcache.engine.payload.payload import MLXPayloadAdapter
from promptcache.serving_config import EngineConfig

BLOCK = 8
CHUNK = 16


class LogitsRecorder:
    """Collects the last-position logits of every sampling step, per request id."""

    def __init__(self) -> None:
        self.by_request: dict[str, list[np.ndarray]] = defaultdict(list)

    def __call__(self, request_id: str, step: int, logits: np.ndarray) -> None:
        self.by_request[request_id].append(logits)


def make_cache(budget=64 * 1024**2, block_size=BLOCK, lower=(), write_through=False):
    """The RAM-tier PromptCache the tests hand to their engines (the engine never
    builds tiers)."""
    return PromptCache(CacheConfig(block_size=block_size, ram_budget_bytes=budget),
                       adapter=MLXPayloadAdapter(), lower=list(lower),
                       write_through=write_through)


def make_engine(path, *, snapshot_every_blocks=1, use_cache=True, budget=64 * 1024**2, **cfg):
    # speculation's gate from a fixed cost (a verify costs a decode step), never timed
    cfg.setdefault("spec_verify_cost", (1.0, 0.0))
    # the restore planner pinned too: tests never depend on timing (test_restore_plan: auto)
    cfg.setdefault("restore_plan", "load")
    rec = LogitsRecorder()
    cache_config = CacheConfig(block_size=BLOCK, ram_budget_bytes=budget)
    eng = Engine.load(
        path,
        EngineConfig(prefill_chunk_tokens=CHUNK, snapshot_every_blocks=snapshot_every_blocks,
                     **cfg),
        cache_config,
        cache=make_cache(budget) if use_cache else None,
        logits_hook=rec,
    )
    eng.recorder = rec
    return eng


def plain_tokens(path, prompt, max_tokens=60):
    """The tokens decoding one at a time gives (no cache, no speculation): the reference
    every speculative run must equal."""
    from promptcache.engine.api import GenerationRequest, SamplingParams

    plain = make_engine(path, use_cache=False)
    try:
        return plain.submit(GenerationRequest(prompt_tokens=prompt, sampling=SamplingParams(
            max_tokens=max_tokens))).result(timeout=300).tokens
    finally:
        plain.close()


class counts:
    """An engine context's counters and its speculator's (``spec_*``), read live."""

    def __init__(self, ctx):
        self._ctx = ctx

    def __getattr__(self, name):
        spec = self._ctx.speculator
        if name.startswith("spec_") and spec is not None:
            return getattr(spec.counters, name)
        return getattr(self._ctx.counters, name)


def speculating(path, seed, n, max_draft, cost):
    """A random ``n``-token prompt, the tokens decoding one at a time gives for it
    (``plain_tokens``), and an engine that speculates with drafts of up to ``max_draft``
    (no cache, no logits hook) and prices verifies with ``cost``."""
    import numpy as np

    toks = tuple(int(t) for t in np.random.default_rng(seed).integers(3, 1000, size=n))
    want = plain_tokens(path, toks)
    eng = make_engine(path, use_cache=False, speculation="suffix", spec_max_draft=max_draft)
    eng._ctx.logits_hook = None
    eng._ctx.speculator.cost = cost
    return toks, want, eng


@pytest.fixture(scope="module")
def engine_factory():
    made = []

    def make(path, **kw):
        eng = make_engine(path, **kw)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()
