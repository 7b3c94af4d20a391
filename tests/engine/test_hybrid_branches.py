"""Hybrid (SSM) state snapshots at message starts (issue 22, item 4): a state that cannot
be truncated restores only where a snapshot exists, so prefill stops at every message
start for one (a partial block ending there carries it when the start is inside a
block). A branch that changes the last user message restores exactly up to that
message's start; an exact repeat at least that far; greedy output equals a full
prefill. Snapshot counts and bytes are in the engine stats."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from promptcache.engine.api import GenerationRequest, SamplingParams

_ids = itertools.count()
# message starts of a four-message conversation (system, user, assistant, user) of 120
# tokens; chunks of 16, blocks of 8; regular snapshots every 8 blocks (64 tokens)
STARTS = (0, 37, 66, 100)
N = 120
EVERY = 8


def _toks(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 1000, size=n)]


def _run(eng, tokens, *, starts=STARTS, use_cache=True, max_tokens=4):
    req = GenerationRequest(prompt_tokens=tuple(tokens), message_starts=tuple(starts),
                            sampling=SamplingParams(max_tokens=max_tokens), use_cache=use_cache,
                            request_id=f"hb-{next(_ids)}")
    res = eng.submit(req).result(timeout=120)
    assert res.finish_reason == "length", res.error
    return res


@pytest.fixture
def eng(tiny_hybrid_path, engine_factory):
    return engine_factory(tiny_hybrid_path, snapshot_every_blocks=EVERY)


def _snapshot_bytes(eng) -> int:
    """Bytes of the model's SSM state after a forward (the oracle for the stats)."""
    model = eng._ctx.model
    caches = make_prompt_cache(model)
    model(mx.array([[5, 6, 7]]), cache=caches)
    arrays = [a for c in caches if isinstance(c, ArraysCache) for a in c.cache if a is not None]
    mx.eval(*arrays)
    return sum(int(a.nbytes) for a in arrays)


def test_branch_at_the_last_user_message_restores_to_its_start(eng):
    conv = [995] + _toks(N - 1, 1)
    before = dict(eng.counters.to_dict())
    first = _run(eng, conv)
    assert first.usage.cached_tokens == 0
    c = eng.counters.to_dict()
    # snapshots at 37, 66, 100 (message starts), 64 (every 8 blocks), 120 (end of the
    # prompt) and 123 (end of generation: prompt + output[:-1])
    assert c["message_snapshots"] - before["message_snapshots"] == 3
    assert c["snapshots"] - before["snapshots"] == 6
    each = _snapshot_bytes(eng)
    assert each > 0 and c["bytes_per_snapshot"] == each
    assert c["snapshot_bytes"] - before["snapshot_bytes"] == 6 * each

    # a branch: the last user message changes after its first 3 tokens (its role header)
    branch = conv[:103] + _toks(12, 2)
    got = _run(eng, branch)
    assert got.usage.cached_tokens == STARTS[-1]  # 100, not the 64-token snapshot
    miss = got.miss
    assert miss is not None and miss.cause == "not_restorable"
    assert (miss.position, miss.restorable, miss.message_index) == (103, 100, 3)
    assert got.tokens == _run(eng, branch, use_cache=False).tokens

    # the exact prompt again: the end-of-prompt snapshot (120) needs the last token
    # re-run; the last message start is the furthest snapshot before it
    again = _run(eng, conv)
    assert again.usage.cached_tokens == STARTS[-1]
    assert again.tokens == first.tokens == _run(eng, conv, use_cache=False).tokens


def test_branch_past_the_message_start_block_still_restores_to_the_start(eng):
    """The branch shares 7 tokens past the start (into the next block, 104..107): the
    snapshot at 100 is a sibling of a block the lookup walked through."""
    conv = [996] + _toks(N - 1, 3)
    _run(eng, conv)
    branch = conv[:107] + _toks(9, 4)
    got = _run(eng, branch)
    assert got.usage.cached_tokens == 100
    assert got.tokens == _run(eng, branch, use_cache=False).tokens


def test_block_aligned_message_start_and_earlier_branches(eng):
    """A message start on a block boundary (96) is snapshotted by its full block; a
    branch at an earlier message (the assistant's, 66) restores to that start."""
    starts = (0, 37, 66, 96)
    conv = [997] + _toks(N - 1, 5)
    before = eng.counters.to_dict()["message_snapshots"]
    _run(eng, conv, starts=starts)
    assert eng.counters.to_dict()["message_snapshots"] - before == 3
    late = conv[:98] + _toks(10, 6)
    r = _run(eng, late, starts=starts)
    assert r.usage.cached_tokens == 96
    assert r.tokens == _run(eng, late, starts=starts, use_cache=False).tokens
    early = conv[:70] + _toks(20, 7)
    r = _run(eng, early, starts=starts[:3])
    assert r.usage.cached_tokens == 66
    assert r.tokens == _run(eng, early, starts=starts[:3], use_cache=False).tokens


def test_chat_branch_through_the_template(eng):
    """Rendered chats: a retry of the last user message with other words restores the
    whole shared history, up to the start of that message."""
    history = [{"role": "system", "content": "You are a terse assistant for shell questions."},
               {"role": "user", "content": "How do I list the files of a folder by size?"},
               {"role": "assistant", "content": "Use ls -lS in that folder; add -h for sizes."},
               {"role": "user", "content": "And only the ten largest ones, please?"}]
    retry = [*history[:3], {"role": "user", "content": "What about hidden files too?"}]
    toks, starts = eng.render_chat_with_offsets(history)
    toks2, starts2 = eng.render_chat_with_offsets(retry)
    assert starts2 == starts and toks2[:starts[-1]] == toks[:starts[-1]]
    _run(eng, toks, starts=starts)
    got = _run(eng, toks2, starts=starts2)
    assert got.usage.cached_tokens == starts[-1]
    assert got.tokens == _run(eng, toks2, starts=starts2, use_cache=False).tokens


def test_truncatable_models_take_no_message_snapshots(tiny_llama_path, engine_factory):
    eng = engine_factory(tiny_llama_path)
    conv = [998] + _toks(N - 1, 8)
    first = _run(eng, conv)
    c = eng.counters.to_dict()
    assert (c["snapshots"], c["message_snapshots"], c["snapshot_bytes"]) == (0, 0, 0)
    assert first.usage.saved_mid_prefill == 112 // 8  # chunks of 16: full blocks only
    assert _run(eng, conv[:103] + _toks(12, 9)).usage.cached_tokens == 103


def test_message_snapshots_bounded_to_the_last_starts(tiny_hybrid_path, engine_factory):
    """``message_snapshots=1``: only the last message start gets a snapshot; a branch at
    an earlier one falls back to the regular snapshot (64 tokens)."""
    eng = engine_factory(tiny_hybrid_path, snapshot_every_blocks=EVERY, message_snapshots=1)
    conv = [999] + _toks(N - 1, 10)
    _run(eng, conv)
    c = eng.counters.to_dict()
    assert (c["message_snapshots"], c["snapshots"]) == (1, 4)  # 100; 64, 120, 123
    assert _run(eng, conv[:103] + _toks(12, 11)).usage.cached_tokens == 100
    assert _run(eng, conv[:70] + _toks(12, 12), starts=STARTS[:3]).usage.cached_tokens == 64


def test_message_snapshots_must_not_be_negative():
    from promptcache.serving_config import EngineConfig

    with pytest.raises(ValueError, match="message_snapshots"):
        EngineConfig(message_snapshots=-1)
