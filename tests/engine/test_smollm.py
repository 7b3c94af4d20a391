"""The real default model (SmolLM2-135M-Instruct): cached == uncached, and a chat's hit rate."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from promptcache.cli.wiring import build_cache
from promptcache.config import CacheConfig
from promptcache.engine.api import GenerationRequest, SamplingParams
from promptcache.engine.engine import Engine
from promptcache.serving_config import EngineConfig

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a friendly assistant. Answer every question in two or three sentences, "
    "use plain words, do not repeat the question, and never make up facts. "
    "If you do not know an answer, say so politely and suggest where to look it up."
)
USER_TURNS = [
    "Hi! Tell me about yourself.",
    "Describe Paris for a visitor.",
    "And what about Rome?",
    "Explain how bread is made.",
    "Why is the sky blue?",
    "Describe a good breakfast.",
    "How do plants grow?",
    "Tell me about the ocean.",
    "Describe a cat.",
    "Thanks! Any last advice?",
]


@pytest.fixture(scope="module")
def smol(default_model_path):
    logits: dict[str, list[np.ndarray]] = {}

    def hook(rid, step, lg):
        logits.setdefault(rid, []).append(lg)

    cc = CacheConfig(block_size=16, ram_budget_bytes=512 * 1024**2)
    # speculation's gate from a fixed cost, not measured at startup (seconds on this model)
    eng = Engine.load(default_model_path, EngineConfig(prefill_chunk_tokens=64,
                                                       spec_verify_cost=(1.0, 0.0)), cc,
                      cache=build_cache(cc), logits_hook=hook)
    eng.logits = logits
    yield eng
    eng.close()


def _run(eng, tokens, use_cache, rid):
    req = GenerationRequest(prompt_tokens=tuple(tokens), sampling=SamplingParams(max_tokens=8),
                            use_cache=use_cache, request_id=rid)
    return eng.submit(req).result(timeout=600), eng.logits.pop(rid)


def test_smollm_cached_equals_uncached(smol):
    base = smol.render_chat([{"role": "user", "content": "Tell me about the sea."}])
    worst = 0.0
    for i, tokens in enumerate([base, base, base[:-5], base[:-9] + base[-3:]]):
        a, la = _run(smol, tokens, True, f"c{i}")
        b, lb = _run(smol, tokens, False, f"u{i}")
        assert a.tokens == b.tokens
        worst = max(worst, max(float(np.max(np.abs(x - y))) for x, y in zip(la, lb, strict=True)))
        if i == 1:
            assert a.usage.cached_tokens == len(base) - 1
    print(f"\nSmolLM2 max |delta logits| = {worst:.3e}")
    assert worst <= 1e-3


def test_smollm_ten_turn_chat_hit_rate(smol):
    # a short system prompt, short user messages, replies of up to 48 tokens: per turn
    # only the template markers + the user message (~18 tokens) are new
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    prompt_total = cached_total = 0
    per_turn = []
    for text in USER_TURNS:
        messages.append({"role": "user", "content": text})
        res = smol.generate(messages, max_tokens=48, session_id="chat-1")
        assert res.finish_reason in ("length", "stop")
        messages.append({"role": "assistant", "content": res.text})
        u = res.usage
        per_turn.append((u.prompt_tokens, u.cached_tokens))
        prompt_total += u.prompt_tokens
        cached_total += u.cached_tokens
    rate = cached_total / prompt_total
    later = sum(c for _, c in per_turn[1:]) / sum(p for p, _ in per_turn[1:])
    print(f"\n10-turn chat: per turn (prompt, cached) = {per_turn}")
    print(f"token hit rate: all turns {rate:.1%}, turns 2-10 {later:.1%}")
    assert per_turn[0][1] == 0 or per_turn[0][1] < per_turn[0][0]
    # every turn reuses at least the whole previous prompt (and most of the reply)
    for (p_prev, _), (_, c) in pairwise(per_turn):
        assert c >= p_prev
    assert rate >= 0.90 and later >= 0.90
