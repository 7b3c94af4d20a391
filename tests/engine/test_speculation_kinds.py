"""Speculative decoding on every cache kind of the architecture matrix.

For each tiny family (plain KV; sliding windows with attention sinks and without; MLA,
whose K and V widths differ; hybrids whose array / SSM state cannot be trimmed; the
``CacheList`` of falcon_h1; kimi_linear's linear attention next to MLA) and for 8-bit
stored KV, rows of 1, 2, 4 and 8 requests decode in one batch, driven step by step
(``Stepper``: no engine thread, no timing), each row with an injected draft source that
is right, wrong or half right (``source_of``). Every row's tokens equal the same run
without speculation; so do log-probabilities (within 1e-4), seeded samples, stops
inside an accepted draft, and the next turn restored from what speculation saved.

Prompts are longer than the sliding window (16) so windows rotate before and during
verify forwards; rows join the batch at different steps (prefill is one chunk per
step), so verify forwards see rows of different lengths and paddings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import counts, make_engine
from models.tiny_families import ensure_family_model
from models.tiny_models import ensure_built
from stepper import Run, Stepper

from promptcache.engine.api import TokenEvent
from promptcache.engine.engine import Engine
from promptcache.engine.speculation.speculator import Speculator

# family -> the cache kind it stands for
KINDS = {
    "llama": "plain KV",
    "gpt_oss": "sliding window + attention sinks",
    "gemma3_text": "sliding window",
    "deepseek_v3": "MLA",
    "glm4_moe_lite": "MLA",
    "qwen3_5": "gated delta net state + KV",
    "qwen3_next": "gated delta net state + KV",
    "nemotron_h": "Mamba2 state + KV",
    "falcon_h1": "CacheList (Mamba2 state, KV)",
    "kimi_linear": "KDA state + MLA",
}
STATEFUL = {"qwen3_5", "qwen3_next", "nemotron_h", "falcon_h1", "kimi_linear"}
# array states that cannot take right-padded tokens (mlx_compat.states_take_lengths)
UNIFORM = {"nemotron_h"}
MAX_TOKENS = 24
DRAFT_KINDS = ("right", "wrong", "half")
Source = Callable[[Any, int], list[int]]


def prompt(seed: int, n: int = 36) -> tuple[int, ...]:
    rng = np.random.default_rng(seed)
    return tuple(int(t) for t in rng.integers(3, 1000, size=n + seed % 5))


def source_of(kind: str, ref: list[int], seed: int) -> Source:
    """Drafts for a request whose non-speculative tokens are ``ref``: the truth, each
    token wrong, or the first half right and the rest wrong."""
    rng = np.random.default_rng(seed)

    def source(r: Any, k: int) -> list[int]:
        truth = ref[len(r.output):len(r.output) + k]
        wrong = [(t + 1 + int(rng.integers(0, 5))) % 1000 for t in truth]
        if kind == "right":
            return truth
        if kind == "wrong":
            return wrong
        half = (len(truth) + 1) // 2
        return truth[:half] + wrong[half:]

    return source


def stepper(eng: Engine, sources: dict[tuple[int, ...], Source] | None) -> Stepper:
    """A scheduler over ``eng``'s model and cache; with ``sources``, speculation whose
    drafts come from them (keyed by prompt)."""
    st = Stepper(eng)
    if sources is not None:
        st.ctx.speculator = Speculator(st.ctx.config,
                                       source=lambda r, k: sources[tuple(r.req.prompt_tokens)](r, k))
    return st


def run_all(st: Stepper, prompts: list[tuple[int, ...]], **kw: Any) -> list[Run]:
    runs = [st.submit(p, MAX_TOKENS if "max_tokens" not in kw else kw.pop("max_tokens"),
                      **kw) for p in prompts]
    st.run()
    assert all(r.result is not None for r in runs)
    return runs


class Family:
    """One family's engine (speculation configured, the logits hook off) and its
    reference runs without speculation."""

    def __init__(self, name: str, eng: Engine) -> None:
        self.name = name
        self.eng = eng
        self.refs: dict[tuple[Any, ...], Run] = {}

    def reference(self, prompts: list[tuple[int, ...]], **kw: Any) -> list[Run]:
        key = (tuple(prompts), tuple(sorted(kw.items())))
        if key not in self.refs:
            runs = run_all(stepper(self.eng, None), prompts, use_cache=False, **kw)
            for r in runs:
                assert r.result is not None and r.result.usage.spec_drafted == 0
            self.refs[key] = runs
        return self.refs[key]


@pytest.fixture(scope="module")
def family(request: pytest.FixtureRequest, models_root: Path) -> Iterator[Family]:
    name = str(request.param)
    eng = make_engine(ensure_family_model(name, models_root), speculation="suffix",
                      spec_max_draft=6)
    eng._ctx.logits_hook = None
    try:
        yield Family(name, eng)
    finally:
        eng.close()


def families() -> list[Any]:
    return [pytest.param(f, id=f) for f in KINDS]


@pytest.mark.parametrize("family", families(), indirect=True)
@pytest.mark.parametrize("rows", [1, 2, 4, 8])
def test_greedy_rows_equal_decoding_without_speculation(family: Family, rows: int) -> None:
    # every fourth prompt is shorter than the sliding window: windows that are not full
    # yet, rows of very different lengths (left padding) in one verify forward
    prompts = [prompt(10 * rows + i, n=6 if i % 4 == 3 else 36) for i in range(rows)]
    want = family.reference(prompts)
    # the first row's drafts are wrong: it decodes slowest, the others join it
    kinds = ["half"] if rows == 1 else [DRAFT_KINDS[(i + 1) % 3] for i in range(rows)]
    sources = {p: source_of(kinds[i], want[i].tokens, i) for i, p in enumerate(prompts)}
    st = stepper(family.eng, sources)
    got = run_all(st, prompts, use_cache=False)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert [g.result.finish_reason for g in got] == ["length"] * rows  # type: ignore[union-attr]
    c = counts(st.ctx)
    assert c.spec_verifies > 0 and c.spec_drafted > 0
    # array states are fed the kept positions again after a verify with rejections
    assert (c.spec_recomputes > 0) == (family.name in STATEFUL)
    if rows > 1:
        assert c.max_batch >= 2
    if rows >= 4:  # (two rows over array states: the gate may keep them from verifying)
        assert c.spec_multirow > 0
    if family.name in UNIFORM and rows > 1:
        return  # rows keep as many positions as the shortest: per-row counts vary
    assert 0 < c.spec_accepted < c.spec_drafted
    for g, kind in zip(got, kinds, strict=True):
        u = g.result.usage  # type: ignore[union-attr]
        if kind == "wrong":
            assert u.spec_accepted == 0 < u.spec_drafted
        elif kind == "right":
            assert u.spec_accepted == u.spec_drafted > 0
        else:
            assert 0 < u.spec_accepted < u.spec_drafted


@pytest.mark.parametrize("family", families(), indirect=True)
def test_logprobs_and_samples_equal_decoding_without_speculation(family: Family) -> None:
    prompts = [prompt(500 + i) for i in range(4)]
    want = family.reference(prompts, logprobs=3)
    sources = {p: source_of(DRAFT_KINDS[i % 3], want[i].tokens, i)
               for i, p in enumerate(prompts)}
    got = run_all(stepper(family.eng, sources), prompts, use_cache=False, logprobs=3)
    for g, w in zip(got, want, strict=True):
        ge = [e for e in g.events if isinstance(e, TokenEvent)]
        we = [e for e in w.events if isinstance(e, TokenEvent)]
        assert [e.token_id for e in ge] == [e.token_id for e in we]
        for a, b in zip(ge, we, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
            assert [v for _, v in a.top_logprobs] == pytest.approx(
                [v for _, v in b.top_logprobs], abs=1e-4)
    sp = {"temperature": 0.9, "top_p": 0.95, "seed": 77}
    want = family.reference(prompts[:2], **sp)
    sources = {p: source_of(DRAFT_KINDS[i], want[i].tokens, i)
               for i, p in enumerate(prompts[:2])}
    st = stepper(family.eng, sources)
    got = run_all(st, prompts[:2], use_cache=False, **sp)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert counts(st.ctx).spec_accepted > 0


@pytest.mark.parametrize("family", families(), indirect=True)
def test_stops_inside_a_draft_and_the_next_turn(family: Family) -> None:
    """max_tokens and a stop string that fall inside an accepted draft end the row
    exactly where decoding without speculation does; what a speculating row saved
    (cache on) restores the next turn to the same tokens."""
    toks = prompt(700)
    full = family.reference([toks])[0]
    text = full.result.text  # type: ignore[union-attr]
    stop = text[len(text) // 2:len(text) // 2 + 4]
    assert stop.strip()
    for kw in ({"max_tokens": 13}, {"stop": (stop,)}):
        want = family.reference([toks], **kw)[0]
        st = stepper(family.eng, {toks: source_of("right", full.tokens, 0)})
        got = run_all(st, [toks], use_cache=False, **kw)[0]
        assert got.result is not None and want.result is not None
        assert (got.tokens, got.result.text, got.result.finish_reason) == \
            (want.tokens, want.result.text, want.result.finish_reason)
        assert counts(st.ctx).spec_accepted > 0
    # cache on: the speculating row's save points, then the next turn from them
    first = prompt(800)
    ref1 = family.reference([first])[0]
    st = stepper(family.eng, {first: source_of("half", ref1.tokens, 1)})
    got1 = run_all(st, [first])[0]
    assert got1.tokens == ref1.tokens
    nxt = first + tuple(ref1.tokens) + prompt(900, n=12)
    ref2 = family.reference([nxt])[0]
    st = stepper(family.eng, {nxt: source_of("half", ref2.tokens, 2)})
    got2 = run_all(st, [nxt])[0]
    assert got2.tokens == ref2.tokens
    assert got2.result is not None and got2.result.usage.cached_tokens > len(first)
    assert st.ctx.counters.store_errors == 0


# ---------------------------------------------------------------- --kv-bits 8


@pytest.fixture(scope="module")
def quant_engine(models_root: Path) -> Iterator[Engine]:
    from models.tiny_families import build_family_model

    path = ensure_built(models_root / "tiny-matrix-llama-hd64-v1",
                        lambda tmp: build_family_model("llama", tmp, {"head_dim": 64}))
    from promptcache.cache import PromptCache
    from promptcache.config import CacheConfig
    from promptcache.engine.payload.payload import MLXPayloadAdapter
    from promptcache.serving_config import EngineConfig

    cc = CacheConfig(block_size=8, ram_budget_bytes=64 * 1024**2, kv_bits=8,
                     kv_quant_min_tokens=0)
    eng = Engine.load(path, EngineConfig(prefill_chunk_tokens=16, speculation="suffix",
                                         spec_max_draft=6, spec_verify_cost=(1.0, 0.0)),
                      cc, cache=PromptCache(cc, adapter=MLXPayloadAdapter()))
    try:
        yield eng
    finally:
        eng.close()


@pytest.mark.parametrize("rows", [1, 2, 4, 8])
def test_quantized_stored_kv_rows_equal_decoding_without_speculation(
        quant_engine: Engine, rows: int) -> None:
    """8-bit stored KV: each row's prompt extends a stored (quantized) prefix, restored
    into the live cache; the rows then decode with and without speculation."""
    base = [prompt(1000 + rows * 10 + i) for i in range(rows)]
    prompts = [b + prompt(2000 + i, n=10) for i, b in enumerate(base)]
    # each side its own tenant: both restore the same stored prefixes
    for tenant in ("off", "on"):
        run_all(stepper(quant_engine, None), base, max_tokens=2, tenant=tenant)
    plain = run_all(stepper(quant_engine, None), prompts, tenant="off")
    kinds = ["half"] if rows == 1 else [DRAFT_KINDS[i % 3] for i in range(rows)]
    sources = {p: source_of(kinds[i], plain[i].tokens, i) for i, p in enumerate(prompts)}
    st = stepper(quant_engine, sources)
    got = run_all(st, prompts, tenant="on")
    assert [g.tokens for g in got] == [p.tokens for p in plain]
    for g, p in zip(got, plain, strict=True):
        assert g.result is not None and p.result is not None
        assert g.result.usage.cached_tokens == p.result.usage.cached_tokens >= 32
    assert counts(st.ctx).spec_accepted > 0


# array states that take right-padded rows: their refeed moves KV heads (finalize_refeed)
REFED = ("qwen3_5", "qwen3_next", "falcon_h1", "kimi_linear")


@pytest.mark.parametrize("family", [pytest.param(f, id=f) for f in REFED], indirect=True)
def test_hybrid_rows_refed_move_their_heads_and_restore_the_same_next_turn(
        family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four rows over array states verify together with right, wrong and half-right
    drafts (cache on): after each refeed of the kept positions, the KV leaves' pad tails
    take rows' first positions (``finalize_refeed``: recorded in ``RowMoves``, no roll of
    whole rows); what each row saves when it ends is read back in temporal order, so
    every next turn restores past its first prompt and decodes the uncached reference."""
    from promptcache.engine import mlx_compat

    original = mlx_compat.finalize_refeed
    moved: list[int] = []

    def spy(batch: Any, moves: Any) -> None:
        before = sum(m.shift for m in moves)
        original(batch, moves)
        moved.append(sum(m.shift for m in moves) - before)

    monkeypatch.setattr(mlx_compat, "finalize_refeed", spy)
    prompts = [prompt(1100 + i, n=36 + 3 * i) for i in range(4)]
    want = family.reference(prompts)
    kinds = ["wrong", "right", "half", "half"]
    sources = {p: source_of(kinds[i], want[i].tokens, i) for i, p in enumerate(prompts)}
    st = stepper(family.eng, sources)
    got = run_all(st, prompts)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    c = counts(st.ctx)
    assert c.spec_multirow > 0 and c.spec_recomputes == len(moved) > 0
    assert any(n > 0 for n in moved)  # heads moved instead of rows rolled
    nxt = [p + tuple(w.tokens) + prompt(1200 + i, n=8) for i, (p, w) in
           enumerate(zip(prompts, want, strict=True))]
    ref2 = family.reference(nxt)
    got2 = run_all(stepper(family.eng, None), nxt)
    assert [g.tokens for g in got2] == [w.tokens for w in ref2]
    for g, p in zip(got2, prompts, strict=True):
        assert g.result is not None and g.result.usage.cached_tokens > len(p)
    assert c.store_errors == 0


@pytest.mark.parametrize("name", list(KINDS))
def test_the_startup_cost_fit_on_every_cache_kind(name: str, models_root: Path) -> None:
    """``measure_verify_cost`` on each family: a cache that can be trimmed back is
    measured over MEASURE_CONTEXT tokens, with what a token of context adds to a step
    (``attend``); array states are measured empty (``at`` 0, ``attend`` 0). The numbers
    are timings: only their form is checked."""
    from mlx_lm.utils import load_model

    from promptcache.engine.speculation.cost import MEASURE_CONTEXT, measure_verify_cost

    model, _ = load_model(ensure_family_model(name, models_root))
    cost = measure_verify_cost(model, 1000, repeats=1)
    assert cost.overhead > 0 and cost.per_token >= 0 and cost.attend >= 0
    if name in STATEFUL:
        assert cost.at == 0 and cost.attend == 0.0
    else:
        assert cost.at == MEASURE_CONTEXT
    assert cost.step(8, 4096) >= cost.step(8, 0) > 0
