"""Sliding windows keep every block: a block is saved while its tokens are still in the
window, so a sliding-window model reuses what a plain-KV model reuses.

Models: a tiny gpt_oss (alternating sliding / full attention layers, the real config's
pattern, a 32-token window, learned attention sinks; built here from mlx-lm's own
classes), the project's tiny gemma3_text (16-token window; blocks of 8 and of 16 = the
window), the same gemma3_text whose windows keep their first tokens (``keep``), and the
tiny llama as the plain-KV reference. Prefill chunks are longer than the window, so a
turn prefills more than a window past the last saved block (the case that lost the
end-of-prefill save: ``token N is no longer in the sliding window``).

Every number is exact: a turn restores the previous turn's prompt + output[:-1], an
exact repeat restores all but the last token, a branch restores the shared prefix,
with zero store errors, and greedy output after a restore equals a full prefill.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import LogitsRecorder, make_cache
from mlx.utils import tree_flatten
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from stepper import Stepper

from promptcache.config import CacheConfig
from promptcache.engine import mlx_compat
from promptcache.engine.engine import Engine
from promptcache.engine.models.loader import load_model_or_vlm
from promptcache.engine.payload import adapters
from promptcache.errors import InvariantError
from promptcache.serving_config import EngineConfig

GPT_OSS_WINDOW = 32
KEEP = 2


def _toks(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 1000, size=n)]


# ---------------------------------------------------------------- the rule itself


def _held_positions(c: RotatingKVCache) -> list[int]:
    """Positions a window can still give a block (values are the positions: see below)."""
    out = []
    for t in range(c.offset):
        try:
            p = adapters.extract_block([c], t, t + 1, snapshot=False)
        except InvariantError:
            continue
        assert float(np.array(p["0.k"]).ravel()[0]) == t
        out.append(t)
    return out


@pytest.mark.parametrize("keep", [0, KEEP])
def test_window_floor_after_is_what_the_window_holds(keep):
    """``window_floor_after`` predicts exactly which tokens a forward of n tokens
    leaves in a RotatingKVCache (in place for one token, concatenated for several)."""
    size, bs = 8, 4
    c = RotatingKVCache(max_size=size, keep=keep)
    ks = mx.arange(200, dtype=mx.float32).reshape(1, 1, 200, 1)
    stored: dict[int, list[float]] = {}
    saved = 0  # the whole blocks before it are stored
    for n in (5, 1, 1, 7, 1, 12, 1, 1, 1, 3, 1, 20, 2, 1, 1, 1, 1, 1, 1, 1, 1, 9, 1):
        floor = mlx_compat.window_floor_after([c], n)
        # the rule of Request.save_before_slide: store what the forward would push out
        if floor > saved:
            while saved + bs <= c.offset:
                p = adapters.extract_block([c], saved, saved + bs, snapshot=False)
                stored[saved] = np.array(p["0.k"]).ravel().tolist()
                saved += bs
            assert floor <= saved  # a partial block is never pushed out (bs <= size - keep)
        start = c.offset
        c.update_and_fetch(ks[..., start : start + n, :], ks[..., start : start + n, :])
        want = list(range(c.offset)) if floor == 0 else [
            *range(min(keep, c.offset)), *range(floor, c.offset)]
        assert _held_positions(c) == want, (n, c.offset)
        assert mlx_compat.window_floor([c]) == floor
    total = c.offset
    while saved < total:  # the end: the rest, tail included, is still in the window
        end = min(saved + bs, total)
        stored[saved] = np.array(adapters.extract_block([c], saved, end, snapshot=False)["0.k"]
                                 ).ravel().tolist()
        saved = end
    assert [v for s in sorted(stored) for v in stored[s]] == [float(t) for t in range(total)]


# ---------------------------------------------------------------- models


def _write_gpt_oss(out: Path, tokenizer_from: Path) -> Path:
    """A tiny gpt_oss folder: 4 layers sliding / full / sliding / full, MoE of 4 experts
    (2 per token), a 32-token window, random attention sinks; the tiny models' tokenizer."""
    src_cfg = json.loads((tokenizer_from / "config.json").read_text())
    config = {
        "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
        "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
        "vocab_size": src_cfg["vocab_size"], "hidden_size": 64, "intermediate_size": 64,
        "head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
        "sliding_window": GPT_OSS_WINDOW, "rope_theta": 150000, "rms_norm_eps": 1e-5,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "max_position_embeddings": 4096, "eos_token_id": src_cfg["eos_token_id"],
        "pad_token_id": src_cfg["pad_token_id"], "torch_dtype": "float32",
    }
    model_cls, args_cls = mlx_compat.model_classes("gpt_oss")
    mx.random.seed(2201)
    model = model_cls(args_cls.from_dict(config))
    for layer in model.layers:  # learned per-head sink logits (zeros at init)
        layer.self_attn.sinks = mx.random.normal((config["num_attention_heads"],))
    weights = {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())}
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_from / name, out / name)
    return out


class KeepWindows(nn.Module):
    """A model whose sliding windows keep their first ``KEEP`` tokens (as mlx-lm's
    ``make_prompt_cache(model, max_kv_size)`` builds them): the same forward, other
    caches."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def __call__(self, inputs, cache=None, input_embeddings=None):
        return self.inner(inputs, cache=cache)

    @property
    def layers(self):
        return self.inner.layers

    def make_cache(self):
        return [RotatingKVCache(max_size=c.max_size, keep=KEEP)
                if isinstance(c, RotatingKVCache) else c for c in self.inner.make_cache()]


@pytest.fixture(scope="module")
def gpt_oss_path(tmp_path_factory, tiny_gemma_path):
    return _write_gpt_oss(tmp_path_factory.mktemp("tiny-gpt-oss"), tiny_gemma_path)


@pytest.fixture(scope="module")
def engines():
    made: list[Engine] = []

    def make(path, block, chunk, *, keep=False, **cfg):
        # the blocks are what these tests reuse: no live state (test_live_state.py)
        ecfg = EngineConfig(prefill_chunk_tokens=chunk, **{"live_states": 0, **cfg})
        ccfg = CacheConfig(block_size=block, ram_budget_bytes=64 * 1024**2)
        cache = make_cache(block_size=block)
        if keep:
            model, tok, info, _ = load_model_or_vlm(path)
            eng = Engine(KeepWindows(model), tok, model_id="keep", fingerprint=info.fingerprint + "-keep",
                         context_length=info.context_length, vocab_size=1024,
                         engine_config=ecfg, cache_config=ccfg, cache=cache,
                         logits_hook=LogitsRecorder())
        else:
            eng = Engine.load(path, ecfg, ccfg, cache=cache, logits_hook=LogitsRecorder())
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()


# (name, window, block, chunk): chunks are longer than the window
CASES = {
    "gpt_oss": (GPT_OSS_WINDOW, 16, 64),
    "gemma3_text": (16, 8, 32),
    "gemma3_text_block_is_window": (16, 16, 64),
    "gemma3_text_keep": (16, 8, 32),
}


def _engine(name, engines, gpt_oss_path, tiny_model_path):
    _window, block, chunk = CASES[name]
    path = gpt_oss_path if name == "gpt_oss" else tiny_model_path("gemma3_text")
    return engines(path, block, chunk, keep=name.endswith("_keep"))


def _conversation(eng, window, seed, turns=4, equal=True):
    """Turns that each add 1-3 windows of new tokens, replies of 1-2 windows. Returns
    [(prompt, result)]; checks every turn restores all of the previous one."""
    rng = np.random.default_rng(seed)
    history = [700 + seed] + _toks(window + 3, seed)
    out = []
    prev = 0
    for t in range(turns):
        res = eng.generate(history, max_tokens=window + 5 + 7 * t)
        assert res.finish_reason in ("length", "stop"), res.error
        assert res.usage.cached_tokens == prev, (t, len(history))
        if equal:
            assert res.tokens == eng.generate(history, max_tokens=len(res.tokens),
                                              use_cache=False).tokens, t
        out.append((history, res))
        prev = len(history) + len(res.tokens) - 1  # prompt + output[:-1] is stored
        new = int(rng.integers(window, 3 * window + 1))
        history = history + res.tokens + _toks(new, seed * 31 + t)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_turns_repeats_and_branches_reuse_every_block(name, engines, gpt_oss_path,
                                                      tiny_model_path):
    window = CASES[name][0]
    eng = _engine(name, engines, gpt_oss_path, tiny_model_path)
    # the windows keep tokens: the forward sees them, so chunking changes the output
    # and a full prefill is no reference (restore == live state is checked below)
    equal = not name.endswith("_keep")
    turns = _conversation(eng, window, seed=1, equal=equal)
    assert eng.counters.store_errors == 0
    # an exact repeat of the last prompt: all but its last token (as plain KV)
    last_prompt, last = turns[-1]
    again = eng.generate(last_prompt, max_tokens=len(last.tokens))
    assert again.usage.cached_tokens == len(last_prompt) - 1
    assert again.tokens == last.tokens
    # a branch off turn 2's prompt, mid-way through what it added (reply + new tokens):
    # the shared prefix
    prompt2, _ = turns[2]
    split = (len(turns[1][0]) + len(prompt2)) // 2
    assert len(prompt2) - split > window and split % CASES[name][1]  # mid-block
    branch = prompt2[:split] + _toks(window + 9, 99)
    res = eng.generate(branch, max_tokens=window)
    assert res.usage.cached_tokens == split
    if equal:
        assert res.tokens == eng.generate(branch, max_tokens=window, use_cache=False).tokens
    assert eng.counters.store_errors == 0


def test_plain_kv_reuses_the_same(engines, tiny_model_path):
    """The reference: the tiny llama, the same conversation shape, the same counts."""
    eng = engines(tiny_model_path("llama"), 8, 32)
    turns = _conversation(eng, 16, seed=1)
    last_prompt, last = turns[-1]
    assert eng.generate(last_prompt, max_tokens=2).usage.cached_tokens == len(last_prompt) - 1
    assert eng.counters.store_errors == 0


def test_keep_windows_restore_the_live_state(engines, tiny_model_path):
    """Windows that keep tokens: a turn restored from blocks continues exactly as the
    request that stored them would have (same chunking from the restored position)."""
    eng = engines(tiny_model_path("gemma3_text"), 8, 32, keep=True)
    assert adapters.min_sliding_tokens(make_prompt_cache(eng.model)) == 16 - KEEP
    prompt = [777] + _toks(70, 5)
    first = eng.generate(prompt, max_tokens=40)
    n = len(prompt) + len(first.tokens) - 1
    turn2 = prompt + first.tokens + _toks(40, 6)
    hit = eng.generate(turn2, max_tokens=6)
    assert hit.usage.cached_tokens == n
    # the reference: prefill [0, n) the way the first request did (its chunks, its last
    # prompt token alone, then one token at a time), then turn 2's suffix from n
    model = eng.model
    caches = make_prompt_cache(eng.model)
    pos = 0
    seq = turn2
    while pos < len(prompt):
        end = min(len(prompt), (pos // 32 + 1) * 32)
        if end == len(prompt) and end - pos > 1:
            model(mx.array(seq[pos : end - 1])[None], cache=caches)
            pos = end - 1
        model(mx.array(seq[pos:end])[None], cache=caches)
        pos = end
    for t in range(pos, n):
        model(mx.array(seq[t : t + 1])[None], cache=caches)
    pos = n
    out = []
    while pos < len(turn2):
        end = min(len(turn2), (pos // 32 + 1) * 32)
        if end == len(turn2) and end - pos > 1:
            model(mx.array(seq[pos : end - 1])[None], cache=caches)
            pos = end - 1
        logits = model(mx.array(seq[pos:end])[None], cache=caches)
        pos = end
    tok = int(mx.argmax(logits[0, -1]).item())
    for _ in range(6):
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=caches)
        tok = int(mx.argmax(logits[0, -1]).item())
    assert hit.tokens == out
    assert eng.counters.store_errors == 0


def test_concurrent_requests_batch_and_keep_every_block(engines, gpt_oss_path):
    """Several requests at once (one prefill chunk per step each, then one batched
    decode): every block stored, each next turn restores all of its request's turn."""
    window, block, chunk = CASES["gpt_oss"]
    eng = engines(gpt_oss_path, block, chunk)
    base = [801] + _toks(2 * window + 5, 40)
    prompts = [base + _toks(window * (1 + i) + 3 * i, 41 + i) for i in range(4)]
    st = Stepper(eng)
    runs = [st.submit(p, max_tokens=2 * window + 3 + i) for i, p in enumerate(prompts)]
    st.run()
    assert st.ctx.counters.max_batch >= 2 and st.ctx.counters.store_errors == 0
    for p, run in zip(prompts, runs, strict=True):
        assert run.result.tokens == eng.generate(p, max_tokens=len(run.tokens),
                                                 use_cache=False).tokens
    nexts = [p + r.result.tokens + _toks(window + 7, 60 + i)
             for i, (p, r) in enumerate(zip(prompts, runs, strict=True))]
    st = Stepper(eng)
    runs2 = [st.submit(p, max_tokens=window) for p in nexts]
    st.run()
    for p, r1, r2 in zip(prompts, runs, runs2, strict=True):
        assert r2.result.usage.cached_tokens == len(p) + len(r1.result.tokens) - 1
    for p, r2 in zip(nexts, runs2, strict=True):
        assert r2.result.tokens == eng.generate(p, max_tokens=window, use_cache=False).tokens
    assert st.ctx.counters.store_errors == 0 and eng.counters.store_errors == 0


def test_block_larger_than_the_sliding_part_is_refused(tiny_model_path):
    path = tiny_model_path("gemma3_text")
    with pytest.raises(ValueError, match="must not exceed the model's sliding window"):
        Engine.load(path, EngineConfig(prefill_chunk_tokens=32),
                    CacheConfig(block_size=32), cache=make_cache(block_size=32))
    model, tok, info, _ = load_model_or_vlm(path)
    with pytest.raises(ValueError, match=r"sliding window \(14 tokens"):
        Engine(KeepWindows(model), tok, model_id="keep", fingerprint="keep",
               context_length=4096, vocab_size=1024,
               engine_config=EngineConfig(prefill_chunk_tokens=16),
               cache_config=CacheConfig(block_size=16), cache=make_cache(block_size=16))


def test_a_block_that_could_not_be_stored_ends_the_saves_quietly(engines, tiny_model_path,
                                                                 caplog):
    """No room for any block (a RAM budget below one block): every block is dropped, the
    first one leaves the window unsaved, and each later save stops there -- counted as
    a window gap, not a store error, nothing logged as an error; generation goes on."""
    path = tiny_model_path("gemma3_text")
    eng = Engine.load(path, EngineConfig(prefill_chunk_tokens=32), CacheConfig(block_size=8),
                      cache=make_cache(budget=1024, block_size=8))
    try:
        prompt = [778] + _toks(60, 7)
        with caplog.at_level("ERROR"):
            res = eng.generate(prompt, max_tokens=20)
        assert res.finish_reason in ("length", "stop")
        assert res.usage.saved_mid_prefill == res.usage.saved_end_prefill == 0
        assert eng.counters.store_errors == 0 and eng.counters.window_gaps > 0
        assert not [r for r in caplog.records if r.levelname == "ERROR"]
        assert res.tokens == eng.generate(prompt, max_tokens=20, use_cache=False).tokens
    finally:
        eng.close()
