"""Batched prefill (engine/requests/prefill.py): requests prefilling at the same step share one
forward per chunk, and that changes nothing a request sees or stores.

Driven step by step through a Stepper (no engine thread, no timing). Greedy tokens
must be identical and logits within TOL (float32: the batched forward sums in
another order than a batch of one), stored blocks identical in ids, hashes, spans
and bytes, their KV within TOL.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CHUNK
from models.quant_models import ensure_tiny_llama_hd64
from stepper import Stepper

TOL = 1e-4


def _prompt(n, seed, first):
    rng = np.random.default_rng(seed)
    return [first] + [int(t) for t in rng.integers(3, 1000, size=n - 1)]


def _run_alone(st, eng, tokens, **kw):
    run = st.submit(tokens, **kw)
    st.run()
    return run.result, eng.recorder.by_request.pop(run.request.request_id)


def _run_together(st, eng, prompts, **kw):
    runs = [st.submit(p, **kw) for p in prompts]
    st.run()
    return [(r.result, eng.recorder.by_request.pop(r.request.request_id)) for r in runs]


def _max_delta(a, b):
    assert len(a) == len(b)
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def _blocks(eng):
    """Every stored block: identity (hash, parent, span, tokens, bytes) -> its arrays."""
    out = {}
    for b in eng.cache.pool.blocks():
        key = (b.block_hash, b.parent_hash, b.start, bytes(b.tokens), b.nbytes)
        out[key] = {k: np.array(v) for k, v in b.payload.items()}
    return out


def _chunk_ends(pos, n):
    """Where a plain-KV request's chunks end (``Request.chunk_end``): at multiples of
    CHUNK, except that a rest of CHUNK + 1 tokens or fewer is one chunk and a chunk
    that would end less than CHUNK / 2 from its start ends at the multiple after."""
    ends = []
    while pos < n:
        end = (pos // CHUNK + 1) * CHUNK
        if n - pos <= CHUNK + 1:
            end = n
        elif end - pos < CHUNK // 2:
            end += CHUNK
        pos = min(n, end)
        ends.append(pos)
    return ends


def test_a_restore_just_before_a_chunk_multiple_costs_no_extra_step(
        tiny_llama_path, engine_factory):
    """Eight requests sent together, each restoring its first turn and prefilling a
    new message that fits in one chunk: one of them restored 1 token before a multiple
    of the chunk size. Every row gets its first token from the same (single) prefill
    forward: the sliver before the multiple rides with the rest, so the round's first
    tokens come together and none waits a step more (chunks used to end at every
    multiple: that row fed 1 token, then the rest at the next step)."""
    eng = engine_factory(tiny_llama_path)
    st = Stepper(eng)
    # turn 1 prompt + output[:-1] restored: 2 * CHUNK - 1 for the first (its 13 new
    # tokens cross 2 * CHUNK), CHUNK for the others (theirs do not)
    lens = [2 * CHUNK - 3] + [CHUNK - 2] * 7
    prompts = [_prompt(n, 300 + i, 700 + i) for i, n in enumerate(lens)]
    firsts = [_run_alone(st, eng, p, max_tokens=3)[0] for p in prompts]
    turn2 = [p + r.tokens + _prompt(12, 400 + i, 750 + i)
             for i, (p, r) in enumerate(zip(prompts, firsts, strict=True))]
    assert _chunk_ends(2 * CHUNK - 1, len(turn2[0])) == [len(turn2[0])]
    c = st.ctx.counters
    before = c.prefill_batches
    runs = [st.submit(p, max_tokens=4) for p in turn2]
    first_step: dict[int, int] = {}
    step = 0
    while not all(r.result is not None for r in runs):
        st.step()
        step += 1
        for i, r in enumerate(runs):
            if i not in first_step and r.tokens:
                first_step[i] = step
    assert [r.result.usage.cached_tokens for r in runs] == [2 * CHUNK - 1] + [CHUNK] * 7
    assert c.prefill_batches - before == 1
    assert len(set(first_step.values())) == 1


PREFIX_LENS = [5, 13, 24, 37, 50, 61, 70, 90]  # turn 1 (prompt lengths)
SUFFIX_LENS = [1, 3, 9, 16, 17, 30, 40, 2]  # turn 2's new tokens: 1 to 3 chunks


def test_batched_prefill_of_restored_prefixes_equals_each_alone(tiny_llama_path, engine_factory):
    """Eight requests restore prefixes of 8 different lengths and prefill suffixes of
    different lengths in one prefill batch: the same tokens, logits, usage and stored
    blocks as each of them prefilled alone on an engine with the same cache."""
    prompts = [_prompt(n, 100 + i, 600 + i) for i, n in enumerate(PREFIX_LENS)]
    batched_eng = engine_factory(tiny_llama_path)
    alone_eng = engine_factory(tiny_llama_path)
    turn2 = []
    for eng in (batched_eng, alone_eng):  # the same first turns, alone, on both
        st = Stepper(eng)
        firsts = [_run_alone(st, eng, p, max_tokens=3)[0] for p in prompts]
        turn2.append([p + r.tokens + _prompt(k, 200 + i, 650 + i)
                      for i, (p, r, k) in enumerate(zip(prompts, firsts, SUFFIX_LENS, strict=True))])
    assert turn2[0] == turn2[1]
    turn2 = turn2[0]

    st = Stepper(batched_eng)
    got = _run_together(st, batched_eng, turn2, max_tokens=6)
    c = st.ctx.counters
    # one forward per chunk: as many as the request with the most chunks (prefix =
    # turn 1's prompt + output[:-1]; _chunk_ends)
    chunks = [len(_chunk_ends(len(p) + 2, len(t))) for p, t in zip(prompts, turn2, strict=True)]
    assert chunks == [1, 1, 1, 1, 2, 2, 3, 1]
    assert c.max_prefill_batch == 8 and c.prefill_batches == max(chunks) == 3
    assert c.active_kv_bytes == 0
    lengths = [len(p) + 6 for p in turn2]
    assert 0 < c.peak_active_kv_bytes <= st.admission.footprint(lengths)

    st_alone = Stepper(alone_eng)
    alone = [_run_alone(st_alone, alone_eng, p, max_tokens=6) for p in turn2]
    assert st_alone.ctx.counters.prefill_batches == 0

    cached = set()
    for (rb, lb), (ra, la), p in zip(got, alone, prompts, strict=True):
        assert rb.finish_reason == "length", rb.error
        assert rb.tokens == ra.tokens
        assert _max_delta(lb, la) <= TOL
        # prompt + output[:-1] of turn 1 came from the cache; only the suffix prefilled
        assert rb.usage.cached_tokens == ra.usage.cached_tokens == len(p) + 2
        cached.add(rb.usage.cached_tokens)
        for point in ("saved_mid_prefill", "saved_end_prefill", "saved_end_generation"):
            assert getattr(rb.usage, point) == getattr(ra.usage, point), point
    assert len(cached) == 8  # eight different restored prefix lengths

    mine, theirs = _blocks(batched_eng), _blocks(alone_eng)
    assert sorted(mine) == sorted(theirs)  # ids, hashes, spans, tokens, bytes
    worst = 0.0
    for key, arrays in mine.items():
        for name, a in arrays.items():
            worst = max(worst, float(np.max(np.abs(a - theirs[key][name]))))
    assert worst <= TOL

    # and the invariant: from the cache == a full prefill (both batched)
    plain = _run_together(Stepper(batched_eng), batched_eng, turn2, max_tokens=6, use_cache=False)
    for (rb, lb), (rp, lp) in zip(got, plain, strict=True):
        assert rb.tokens == rp.tokens and _max_delta(lb, lp) <= TOL


@pytest.mark.parametrize("long_lens", [(160,), (160, 128)])
def test_long_prompts_delay_decoding_rows_by_one_chunk_per_step(
        tiny_llama_path, engine_factory, long_lens):
    """Counted in scheduler steps: while long prompts prefill (alone, or two together
    in the prefill batch), every decoding row gets one token per step and every long
    prompt advances one chunk per step, so its first token comes after
    ceil(n / chunk) steps."""
    eng = engine_factory(tiny_llama_path)
    st = Stepper(eng)
    shorts = [st.submit(_prompt(10, 300 + i, 700 + i), max_tokens=40, use_cache=False)
              for i in range(3)]
    while len(st.scheduler.batch) < 3:
        st.step()
    st.step()  # every row has reported its pipelined token
    assert st.ctx.counters.max_prefill_batch == 3  # the three arrived together
    batches = st.ctx.counters.prefill_batches
    longs = [st.submit(_prompt(n, 310 + i, 710 + i), max_tokens=4, use_cache=False)
             for i, n in enumerate(long_lens)]
    first_token_step = {}
    for k in range(1, max(long_lens) // CHUNK + 1):
        before = [len(r.tokens) for r in shorts]
        pos = [r.req.pos if r.req is not None else 0 for r in longs]
        st.step()
        assert [len(r.tokens) for r in shorts] == [b + 1 for b in before]
        for i, r in enumerate(longs):
            if i in first_token_step:
                continue
            assert r.req.pos - pos[i] == CHUNK  # one chunk, never more
            if r.tokens:
                first_token_step[i] = k
    assert first_token_step == {i: n // CHUNK for i, n in enumerate(long_lens)}
    # alone: the per-request path; two: one batched forward per step, 10 steps
    assert st.ctx.counters.prefill_batches - batches == (0 if len(longs) == 1 else 10)
    st.run()
    eng.recorder.by_request.clear()
    assert all(r.result.finish_reason == "length" for r in shorts + longs)


def test_rows_and_tokens_per_step_are_bounded(tiny_llama_path, engine_factory):
    """prefill_batch_size / prefill_batch_tokens bound a step; the others wait their
    turn and still get what they would alone."""
    eng = engine_factory(tiny_llama_path)
    prompts = [_prompt(20 + i, 400 + i, 720 + i) for i in range(6)]
    st = Stepper(eng)
    alone = [_run_alone(st, eng, p, max_tokens=5, use_cache=False) for p in prompts]
    # prompts of 20..25 tokens: a 16-token first chunk, then 4..9 tokens; (rows, tokens)
    # of every prefill step: full rows wait for a free row, a chunk that would pass the
    # token budget waits for the next step
    expect = {(3, 10_000): [(3, 48), (3, 15), (3, 48), (3, 24)],
              (8, 40): [(2, 32), (3, 25), (3, 38), (3, 31), (1, 9)]}
    for size, budget in expect:
        st = Stepper(eng, prefill_batch_size=size, prefill_batch_tokens=budget)
        group = st.scheduler.group
        seen = []
        step = group.step

        def spy(step=step, group=group, seen=seen):
            seen.append((len(group), group.step_tokens()))
            return step()

        group.step = spy
        got = _run_together(st, eng, prompts, max_tokens=5, use_cache=False)
        assert seen == expect[size, budget]
        for (rb, lb), (ra, la) in zip(got, alone, strict=True):
            assert rb.tokens == ra.tokens and _max_delta(lb, la) <= TOL


def test_cancel_a_row_of_the_prefill_batch(tiny_llama_path, engine_factory):
    eng = engine_factory(tiny_llama_path)
    prompts = [_prompt(64, 500 + i, 730 + i) for i in range(3)]
    st = Stepper(eng)
    alone = [_run_alone(st, eng, p, max_tokens=5, use_cache=False) for p in prompts]
    st = Stepper(eng)
    runs = [st.submit(p, max_tokens=5) for p in prompts]
    st.step()
    st.step()  # two of four chunks: saved at 16 and 32
    assert len(st.scheduler.group) == 3
    runs[1].cancel()
    st.run()
    eng.recorder.by_request.clear()
    res = runs[1].result
    assert res.finish_reason == "cancelled" and res.tokens == []
    assert res.usage.saved_mid_prefill == 4  # 32 tokens = 4 blocks, stored before the cancel
    for i in (0, 2):
        assert runs[i].result.tokens == alone[i][0].tokens


# ---------------------------------------------------------------- quantized KV


@pytest.fixture(scope="module")
def hd64_path(tiny_llama_path, models_root):
    return ensure_tiny_llama_hd64(tiny_llama_path, models_root)


class QuantStepper(Stepper):
    """Requests whose ids are in ``quantized`` run with mlx-lm's QuantizedKVCache."""

    def __init__(self, engine, **config) -> None:
        super().__init__(engine, **config)
        self.quantized: set[str] = set()

    def _make(self, ticket):
        req = super()._make(ticket)
        if req.request_id in self.quantized:
            start = req.start

            def quantized_start() -> None:
                start()
                req.caches = [c.to_quantized(group_size=64, bits=8) for c in req.caches]

            req.start = quantized_start
        return req

    def submit_quantized(self, tokens, **kw):
        self.quantized.add(f"step-{self._ids + 1}")
        return self.submit(tokens, **kw)


def test_a_quantized_kv_request_beside_a_prefill_batch(hd64_path, engine_factory):
    """A request with quantized live KV (mlx-lm cannot batch it) arrives with three
    plain ones: it prefills and decodes on the per-request path, the three prefill as
    one batch; each gets what it gets alone."""
    eng = engine_factory(hd64_path)
    plain = [_prompt(20 + 7 * i, 600 + i, 740 + i) for i in range(3)]
    quant = _prompt(30, 610, 750)
    st = QuantStepper(eng)
    qrun = st.submit_quantized(quant, max_tokens=6, use_cache=False)
    st.run()
    q_alone = (qrun.result, eng.recorder.by_request.pop(qrun.request.request_id))
    p_alone = [_run_alone(st, eng, p, max_tokens=6, use_cache=False) for p in plain]
    assert st.ctx.counters.solo_steps > 0 and st.ctx.counters.prefill_batches == 0

    st = QuantStepper(eng)
    qrun = st.submit_quantized(quant, max_tokens=6, use_cache=False)
    runs = [st.submit(p, max_tokens=6, use_cache=False) for p in plain]
    st.run()
    c = st.ctx.counters
    assert c.max_prefill_batch == 3 and c.solo_steps > 0 and c.max_batch == 3
    got_q = (qrun.result, eng.recorder.by_request.pop(qrun.request.request_id))
    assert got_q[0].tokens == q_alone[0].tokens and _max_delta(got_q[1], q_alone[1]) <= TOL
    for r, (ra, la) in zip(runs, p_alone, strict=True):
        lb = eng.recorder.by_request.pop(r.request.request_id)
        assert r.result.tokens == ra.tokens and _max_delta(lb, la) <= TOL


def test_the_prefill_workspace_stays_within_the_kv_budget(tiny_llama_path, engine_factory):
    """The attention workspace of a batched chunk (rows x heads x chunk x context fp32
    tensors) must fit in what the admitted requests' KV reservations leave of the KV
    budget: with room for exactly two rows' workspace, four prompts prefill two by two
    (each waiting one counted), and each still gets what it gets alone."""
    from promptcache.engine.requests.prefill import attention_heads, workspace_bytes

    eng = engine_factory(tiny_llama_path)
    assert attention_heads(eng._ctx.model) == 4
    prompts = [_prompt(40, 500 + i, 730 + i) for i in range(4)]
    st = Stepper(eng)
    alone = [_run_alone(st, eng, p, max_tokens=5, use_cache=False) for p in prompts]
    reserved = 4 * eng.row_bytes(45)  # four admitted requests of 40 + 5 tokens
    two = workspace_bytes(2, CHUNK, 40, 4)
    assert two == 3 * 4 * 2 * 4 * CHUNK * 40
    # (rows, tokens) of every prefill step: 40 tokens = chunks of 16, 16 and 8 - 1 (the
    # last token is held back for the first-token forward)
    pairs = [(2, 32), (2, 32), (2, 16)] * 2
    for budget, expect, waits in [(reserved + two, pairs, 3),
                                  # one byte less: one row at a time, until the first
                                  # two have finished and released their reservations
                                  (reserved + two - 1, [(1, 16), (1, 16), (1, 8)] * 2
                                   + [(1, 16), (2, 32), (2, 24), (1, 8)], 7),
                                  (None, [(4, 64), (4, 64), (4, 32)], 0)]:
        st = Stepper(eng, active_kv_budget_bytes=budget)
        group = st.scheduler.group
        seen: list[tuple[int, int]] = []
        step = group.step

        def spy(step=step, group=group, seen=seen):
            seen.append((len(group), group.step_tokens()))
            return step()

        group.step = spy
        got = _run_together(st, eng, prompts, max_tokens=5, use_cache=False)
        assert seen == expect
        assert st.ctx.counters.prefill_workspace_waits == waits
        for (rb, lb), (ra, la) in zip(got, alone, strict=True):
            assert rb.tokens == ra.tokens and _max_delta(lb, la) <= TOL
