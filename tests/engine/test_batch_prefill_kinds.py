"""Batched prefill for every cache kind mlx-lm can batch exactly, family by family.

For each tiny model of ``tiny_families`` (plain KV, MLA, sliding windows with and
without sinks, gated-delta-net / KDA / Mamba2 states, ``CacheList``, 4-bit weights):
4 requests of different lengths prefill together (turn 1 from nothing, turn 2 from
each one's restored prefix of a different length) on one engine, and one at a time on
another engine with the same cache contents. Greedy tokens must be identical, logits
within ``TOL`` of their size, every save point the same (same blocks, hashes, spans,
bytes; arrays within ``TOL``), 0 store errors and 0 window gaps, and the batched engine
must really have batched (``prefill_batches``, ``max_prefill_batch``) -- except
``nemotron_h``, which prefills alone: its Mamba2 scan ignores the padding lengths
(``test_nemotron_h_padded_prefill_is_not_exact`` shows by how much).

Driven step by step through a Stepper (no engine thread, no timing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import BLOCK, CHUNK, LogitsRecorder, make_cache
from mlx_lm.models.cache import make_prompt_cache
from models.tiny_families import FAMILIES, ensure_family_model
from stepper import Stepper

from promptcache.config import CacheConfig
from promptcache.engine import mlx_compat
from promptcache.engine.engine import Engine
from promptcache.engine.payload import adapters
from promptcache.serving_config import EngineConfig

TOL = 1e-4  # |batched - alone| / max(1, |alone|), logits and stored arrays
NOT_BATCHED = {"nemotron_h"}  # mlx_compat.RIGHT_PADDED_STATE_MODULES leaves it out
# caches that can be trimmed and hold no window: their chunks take no sliver
# (Request.chunk_end)
PLAIN_KV = {"llama", "qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe_lite", "qwen3_4bit"}

# turn 1: prompt lengths; turn 2 restores prompt + reply[:-1] (len + 2, replies of 3)
TURN1 = (29, 13, 45, 21)
# turn 2's whole prompt: restored 31, 15, 47, 23 -> for windows and array states the
# first step's chunks are 1, 0 (only the last token), 1, 0 tokens (a two-wide forward
# for a sliding window), then 16 + 16 + 5, -, 9, - : four lengths, each row ending at
# its own step; plain KV takes no sliver: 17, 0, 10, 0, then 16 + 5
TURN2 = (70, 16, 58, 24)


def _tokens(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 1000, size=n)]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))


def _blocks(eng: Any) -> dict[tuple[Any, ...], dict[str, np.ndarray]]:
    out = {}
    for b in eng.cache.pool.blocks():
        key = (b.block_hash, b.parent_hash, b.start, bytes(b.tokens), b.nbytes)
        out[key] = {k: np.array(v) for k, v in b.payload.items()}
    return out


def _results(st: Stepper, eng: Any, prompts: list[list[int]], together: bool,
             max_tokens: int) -> list[tuple[Any, list[np.ndarray]]]:
    if together:
        runs = [st.submit(p, max_tokens=max_tokens) for p in prompts]
        st.run()
    else:
        runs = []
        for p in prompts:
            runs.append(st.submit(p, max_tokens=max_tokens))
            st.run()
    return [(r.result, eng.recorder.by_request.pop(r.request.request_id)) for r in runs]


@pytest.fixture(scope="module")
def family_path(models_root: Path) -> Any:
    return lambda family: ensure_family_model(family, models_root)


@pytest.fixture
def engines() -> Any:
    made: list[Engine] = []

    def make(path: Path, chunk: int) -> Engine:
        eng = Engine.load(path, EngineConfig(prefill_chunk_tokens=chunk, snapshot_every_blocks=1),
                          CacheConfig(block_size=BLOCK, ram_budget_bytes=64 * 1024**2),
                          cache=make_cache(), logits_hook=LogitsRecorder())
        eng.recorder = eng._ctx.logits_hook  # type: ignore[attr-defined]
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()


SLIDING = ("gpt_oss", "gemma3_text")  # windows of 16 tokens
# every family with chunks of 16; the sliding ones also with chunks of 32, longer than
# their window: a row's last token then slides blocks out that no chunk end saved yet
# (the batch stores them first, as alone: save_before_slide)
CASES = [pytest.param(f, CHUNK, id=f) for f in FAMILIES] + [
    pytest.param(f, 2 * CHUNK, id=f"{f}-chunk32") for f in SLIDING]


@pytest.mark.parametrize(("family", "chunk"), CASES)
def test_four_requests_prefilled_together_equal_each_alone(
        family: str, chunk: int, family_path: Any, engines: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    widths: list[tuple[tuple[int, ...], int]] = []
    real_width = mlx_compat.prefill_width

    def spy(batch: Any, lengths: Any) -> int:
        w = real_width(batch, lengths)
        widths.append((tuple(lengths), w))
        return w

    monkeypatch.setattr(mlx_compat, "prefill_width", spy)
    path = family_path(family)
    batched, alone = engines(path, chunk), engines(path, chunk)
    st_b, st_a = Stepper(batched), Stepper(alone)
    turn1 = [_tokens(n, 10 * i + 1) for i, n in enumerate(TURN1)]

    got: list[list[tuple[Any, list[np.ndarray]]]] = []
    ref: list[list[tuple[Any, list[np.ndarray]]]] = []
    got.append(_results(st_b, batched, turn1, True, 3))
    ref.append(_results(st_a, alone, turn1, False, 3))
    assert [r.tokens for r, _ in got[0]] == [r.tokens for r, _ in ref[0]]
    turn2 = [p + r.tokens + _tokens(n - len(p) - 3, 10 * i + 2)
             for i, (p, (r, _), n) in enumerate(zip(turn1, ref[0], TURN2, strict=True))]
    assert [len(p) for p in turn2] == list(TURN2)
    got.append(_results(st_b, batched, turn2, True, 5))
    ref.append(_results(st_a, alone, turn2, False, 5))

    for turn, (mine, theirs) in enumerate(zip(got, ref, strict=True)):
        for (rb, lb), (ra, la) in zip(mine, theirs, strict=True):
            assert rb.finish_reason == ra.finish_reason == "length", (turn, rb.error)
            assert rb.tokens == ra.tokens, turn
            assert len(lb) == len(la)
            assert max(_rel(x, y) for x, y in zip(lb, la, strict=True)) <= TOL, turn
            assert rb.usage == ra.usage, turn  # cached tokens, every save point
    # turn 2 restored a different prefix for each: prompt + reply[:-1]
    assert [r.usage.cached_tokens for r, _ in got[1]] == [n + 2 for n in TURN1]

    cb, ca = st_b.ctx.counters, st_a.ctx.counters
    template = make_prompt_cache(st_b.ctx.model)
    plain = adapters.is_truncatable(template) and not adapters.has_sliding_window(template)
    assert plain == (family in PLAIN_KV)
    assert ca.prefill_batches == 0
    for c in (cb, ca):
        assert (c.store_errors, c.restore_errors, c.cache_errors, c.errors, c.window_gaps
                ) == (0, 0, 0, 0, 0)
    if family in NOT_BATCHED:
        assert cb.prefill_batches == 0 and widths == []
    elif chunk == CHUNK and plain:
        assert cb.max_prefill_batch == 4
        # plain KV takes no sliver (Request.chunk_end): turn 1's longest prompt (45)
        # takes 3 chunks (to 16, 32, 45), turn 2's longest (70 from 31) 3 (to 48, 64,
        # 70: the 1 token before 32 rides with the next chunk)
        assert cb.prefill_batches == 3 + 3
        # turn 2's first step: rows of 17, 0, 10, 0 tokens (row 2: 47 -> 57, then its
        # last token: the rest of its prompt fits in one chunk)
        assert ((17, 0, 10, 0), 17) in widths
    elif chunk == CHUNK:
        assert cb.max_prefill_batch == 4
        # one forward per step: turn 1's longest prompt (45) takes 3 chunks of 16, turn
        # 2's longest (70 from 31) takes 4 (to 32, 48, 64, 70)
        assert cb.prefill_batches == 3 + 4
        # turn 2's first step: rows of 1, 0, 1, 0 tokens
        assert ((1, 0, 1, 0), 2 if family in SLIDING else 1) in widths
    else:
        assert cb.max_prefill_batch == 4
        assert cb.prefill_batches == 2 + 3  # 45 = 32 + 13; 70 from 31: to 32, 64, 70
        assert ((1, 0, 10, 0), 10) in widths  # row 2: 47 -> 57, then its last token

    mine_b, theirs_b = _blocks(batched), _blocks(alone)
    assert sorted(mine_b) == sorted(theirs_b)  # ids, hashes, spans, tokens, bytes
    worst = 0.0
    for key, arrays in mine_b.items():
        assert sorted(arrays) == sorted(theirs_b[key])
        for name, a in arrays.items():
            worst = max(worst, _rel(a, theirs_b[key][name]))
    assert worst <= TOL


def test_nemotron_h_padded_prefill_is_not_exact(family_path: Any) -> None:
    """Why nemotron_h prefills alone: after a right-padded batch forward (mlx-lm's own
    ``prepare(lengths, right_padding)`` / ``finalize()``) the padded row's conv state is
    right but its Mamba2 state is lost (the scan takes the decay at the padded last
    position, 0: the state keeps none of the chunk). If mlx-lm starts passing the
    lengths to that scan, this fails: add the module to
    ``mlx_compat.RIGHT_PADDED_STATE_MODULES``."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache

    model, _ = load(str(family_path("nemotron_h")))
    prompts = [_tokens(CHUNK, 1), _tokens(CHUNK - 5, 2)]
    alone = []
    for p in prompts:
        c = make_prompt_cache(model)
        mx.eval(model(mx.array(p)[None], cache=c))
        alone.append(c)
    batch = mlx_compat.merge_requests([make_prompt_cache(model) for _ in prompts])
    inputs = np.zeros((2, CHUNK), dtype=np.uint32)
    for i, p in enumerate(prompts):
        inputs[i, : len(p)] = p
    mlx_compat.prepare_right_padded(batch, [len(p) for p in prompts])
    mx.eval(model(mx.array(inputs), cache=batch))
    mlx_compat.finalize_right_padded(batch)
    layers = [i for i, c in enumerate(batch) if isinstance(c, ArraysCache)]
    assert layers == [0, 2]  # Mamba2, attention, MoE, Mamba2
    for i in layers:
        for row, c in enumerate(alone):
            conv, ssm = (np.array(c[i][k][0]) for k in (0, 1))
            conv_b, ssm_b = (np.array(batch[i][k][row]) for k in (0, 1))
            assert _rel(conv_b, conv) <= TOL
            off = float(np.max(np.abs(ssm_b - ssm)) / np.max(np.abs(ssm)))
            if row == 0:  # no padding: exact
                assert off <= TOL
            else:  # 5 pad tokens: the state is off by its whole size
                assert off >= 0.99


def test_can_batch_prefill_by_kind(family_path: Any) -> None:
    """The rule the scheduler applies, per family (the README table's column)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    got, unknown_model = {}, {}
    for family in FAMILIES:
        model, _ = load(str(family_path(family)))
        caches = make_prompt_cache(model)
        mx.eval(model(mx.array([[1]]), cache=caches))
        got[family] = mlx_compat.can_batch_prefill(caches, model)
        unknown_model[family] = mlx_compat.can_batch_prefill(caches)
    assert {f for f, ok in got.items() if not ok} == NOT_BATCHED
    # array states batch only for a module known to honour the padding
    assert {f for f, ok in unknown_model.items() if not ok} == {
        "qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h", "falcon_h1", "kimi_linear"}


@pytest.mark.parametrize("family", ["gpt_oss", "gemma3_text", "qwen3_next", "falcon_h1",
                                    "kimi_linear"])
def test_rows_that_join_a_running_prefill_batch(family: str, family_path: Any,
                                                engines: Any) -> None:
    """Two requests start a prefill batch; two more join it one step later (their
    caches extend the batch's windows / states mid-prefill): all four equal alone."""
    path = family_path(family)
    batched, alone = engines(path, CHUNK), engines(path, CHUNK)
    prompts = [_tokens(n, 50 + i) for i, n in enumerate((61, 40, 37, 52))]
    st = Stepper(batched)
    runs = [st.submit(p, max_tokens=4) for p in prompts[:2]]
    st.step()
    assert len(st.scheduler.group) == 2
    runs += [st.submit(p, max_tokens=4) for p in prompts[2:]]
    st.run()
    got = [(r.result, batched.recorder.by_request.pop(r.request.request_id)) for r in runs]
    ref = _results(Stepper(alone), alone, prompts, False, 4)
    assert st.ctx.counters.max_prefill_batch == 4
    for (rb, lb), (ra, la) in zip(got, ref, strict=True):
        assert rb.tokens == ra.tokens and rb.usage == ra.usage
        assert max(_rel(x, y) for x, y in zip(lb, la, strict=True)) <= TOL
    assert sorted(_blocks(batched)) == sorted(_blocks(alone))
    assert st.ctx.counters.store_errors == st.ctx.counters.window_gaps == 0
