"""MLA models store and restore their cache: deepseek_v3, glm4_moe_lite, kimi_linear,
deepseek_v32 (tiny random-weight models, ``mla_models``).

MLA's KVCache holds keys (the compressed latent, 64 wide here) and values (the rope
key, 16 wide) of different widths; a block's layout records both shapes. Each model
saves blocks without a store error, the RAM and the SSD tier restore them (exact hit
token counts), greedy output from a restored cache equals a full prefill, and the
second turn of a conversation reuses the first.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, make_prompt_cache
from models.mla_models import KINDS, KV_LORA_RANK, ROPE_DIM, ensure_tiny_mla
from stepper import Stepper

from promptcache.cache import PromptCache
from promptcache.cli.wiring import build_cache
from promptcache.config import CacheConfig, SSDConfig
from promptcache.engine.engine import Engine
from promptcache.engine.payload import adapters
from promptcache.engine.payload.blockbuf import BlockPayload, pack
from promptcache.engine.payload.blocklayout import Item, format_layout, parse_layout
from promptcache.engine.payload.payload import MLXPayloadAdapter
from promptcache.engine.payload.quant import KVQuant
from promptcache.hashing import CACHE_FORMAT_VERSION
from promptcache.meta import Namespace
from promptcache.serving_config import EngineConfig
from promptcache.tiers.ssd import SSDTier

BLOCK = 8
MLA_ITEM = f"kv:float32:1x1x{{n}}x{KV_LORA_RANK},1x1x{{n}}x{ROPE_DIM}"
PROMPT_LEN = 30
MAX_TOKENS = 4
# what a repeat of the prompt hits: everything but the last token, which re-runs; the
# hybrid kimi_linear restores only at a state snapshot (mid-prefill, at the end of the
# first 16-token chunk: the end-of-prompt snapshot is at the last token)
REPEAT_HIT = {"deepseek_v3": 29, "glm4_moe_lite": 29, "deepseek_v32": 29, "kimi_linear": 16}


@pytest.fixture(scope="module", params=KINDS)
def mla(request: pytest.FixtureRequest, tiny_llama_path: Path, models_root: Path
        ) -> tuple[str, Path]:
    kind = str(request.param)
    return kind, ensure_tiny_mla(kind, tiny_llama_path, models_root)


def _prompt(kind: str, n: int = PROMPT_LEN, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed + 10 * KINDS.index(kind))
    return [900 + KINDS.index(kind)] + [int(t) for t in rng.integers(3, 1000, size=n - 1)]


def make_cache() -> PromptCache:
    return PromptCache(CacheConfig(block_size=BLOCK, ram_budget_bytes=64 * 1024**2),
                       adapter=MLXPayloadAdapter())


def _engine(path: Path, cache: PromptCache | None = None) -> Engine:
    # the blocks' layouts are what these tests restore: no live state
    return Engine.load(path, EngineConfig(restore_plan="load", prefill_chunk_tokens=16, snapshot_every_blocks=1,
                                          live_states=0),
                       CacheConfig(block_size=BLOCK, ram_budget_bytes=64 * 1024**2),
                       cache=cache if cache is not None else make_cache())


# ---------------------------------------------------------------- layouts


def test_layout_of_keys_and_values_of_different_widths():
    items = [Item(str(i), "kv", "float32", (1, 1, 8, 64), vshape=(1, 1, 8, 16)) for i in range(3)]
    items.append(Item("3", "kv", "float32", (1, 2, 8, 16), vshape=(1, 2, 8, 16)))  # equal: None
    assert items[3].vshape is None
    text = format_layout(items)
    assert text == "0-2=kv:float32:1x1x8x64,1x1x8x16;3=kv:float32:1x2x8x16"
    lay = parse_layout(text)
    assert lay.items == tuple(items) and lay.num_tokens == 8
    assert {n: (p.offset, p.nbytes, p.shape) for n, p in lay.parts.items()} == {
        "0.k": (0, 2048, (1, 1, 8, 64)), "0.v": (2048, 512, (1, 1, 8, 16)),
        "1.k": (2560, 2048, (1, 1, 8, 64)), "1.v": (4608, 512, (1, 1, 8, 16)),
        "2.k": (5120, 2048, (1, 1, 8, 64)), "2.v": (7168, 512, (1, 1, 8, 16)),
        "3.k": (7680, 1024, (1, 2, 8, 16)), "3.v": (8704, 1024, (1, 2, 8, 16))}
    assert lay.nbytes == 9728
    # quantized: one group size for both widths, parts of each width
    q = parse_layout("0=q8g32:float32:1x1x8x64,1x1x8x32")
    assert {n: p.shape for n, p in q.parts.items()} == {
        "0.k.0": (1, 1, 8, 16), "0.v.0": (1, 1, 8, 8), "0.k.1": (1, 1, 8, 2),
        "0.v.1": (1, 1, 8, 1), "0.k.2": (1, 1, 8, 2), "0.v.2": (1, 1, 8, 1)}
    assert q.items[0].value_shape == (1, 1, 8, 32)


@pytest.mark.parametrize("text", [
    "0=kv:float32:1x1x8x64,1x1x7x16",      # the values hold other tokens
    "0=kv:float32:1x1x8x64,2x1x8x16",      # another batch
    "0=kv:float32:1x1x8x64,1x1x8x64",      # equal shapes are written once
    "0=kv:float32:1x1x8x64,1x8x16",        # not 4-d
    "0=s0:float32:1x4,1x5",                # only KV items have a value shape
    "0=q8g32:float32:1x1x8x64,1x1x8x16",   # 16 is no multiple of the group
    "0=kv:float32:1x1x8x64,1x1x8x16,1x1x8x16",
])
def test_malformed_value_shapes_are_refused(text):
    with pytest.raises(ValueError):
        parse_layout(text)


def test_pack_and_restore_keys_and_values_of_different_widths():
    mx.random.seed(3)
    c = KVCache()
    c.update_and_fetch(mx.random.normal((1, 1, 12, 64)), mx.random.normal((1, 1, 12, 16)))
    blocks = [(adapters.BlockSpan(s, e), adapters.extract_block([c], s, e, False))
              for s, e in ((0, 8), (8, 12))]
    assert [p.layout.text for _, p in blocks] == ["0=" + MLA_ITEM.format(n=8),
                                                  "0=" + MLA_ITEM.format(n=4)]
    assert [p.nbytes for _, p in blocks] == [2560, 1280]
    for n in (12, 10, 5):
        (r,) = adapters.restore([KVCache()], blocks, n, reserve=3)
        k, v, off = r.state
        assert off == n and k.shape[-1] == 64 and v.shape[-1] == 16
        assert mx.array_equal(k[..., :n, :], c.keys[..., :n, :]).item()
        assert mx.array_equal(v[..., :n, :], c.values[..., :n, :]).item()
    # round trip through the lower tiers' form (one buffer + its layout)
    ad = MLXPayloadAdapter()
    back = ad.from_buffer(*ad.to_buffer(blocks[0][1]))
    assert isinstance(back, BlockPayload) and back.layout is blocks[0][1].layout
    assert mx.array_equal(back["0.v"], c.values[..., :8, :]).item()


def test_quantized_blocks_of_different_widths():
    mx.random.seed(4)
    c = KVCache()
    c.update_and_fetch(mx.random.normal((1, 1, 8, 64)), mx.random.normal((1, 1, 8, 32)))
    p = adapters.extract_block([c], 0, 8, False, quant=KVQuant(8, 64, 0))
    assert p.layout.text == "0=q8g32:float32:1x1x8x64,1x1x8x32"  # 32 divides both
    (r,) = adapters.restore([KVCache()], [(adapters.BlockSpan(0, 8), p)], 8)
    assert r.keys.shape == (1, 1, 8, 64) and r.values.shape == (1, 1, 8, 32)
    assert float(mx.abs(r.values - c.values[..., :8, :]).max()) < 0.05
    # MLA's real widths (rope 64) and the tiny ones (rope 16: no group divides it)
    c16 = KVCache()
    c16.update_and_fetch(mx.random.normal((1, 1, 8, 64)), mx.random.normal((1, 1, 8, 16)))
    assert adapters.extract_block([c16], 0, 8, False, quant=KVQuant(8, 64, 0)).layout.text == \
        "0=" + MLA_ITEM.format(n=8)


# ---------------------------------------------------------------- refused at load


def test_check_storable_names_what_cannot_be_stored():
    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 1, 1, 64)), mx.zeros((1, 1, 1, 16), dtype=mx.float16))
    with pytest.raises(ValueError, match=r"cannot be stored in blocks: layer 0: keys are "):
        adapters.check_storable([KVCache()], [c], 1)
    ok = KVCache()
    ok.update_and_fetch(mx.ones((1, 1, 1, 64)), mx.ones((1, 1, 1, 16)))
    adapters.check_storable([KVCache()], [ok], 1)


class _ChunkedModel:
    """A tiny llama whose caches are ChunkedKVCache (llama4's), which blocks cannot hold."""

    def __init__(self, model: object) -> None:
        self.inner = model

    def __call__(self, inputs: mx.array, cache: object = None) -> mx.array:
        return self.inner(inputs, cache=cache)  # type: ignore[operator]

    def make_cache(self) -> list[object]:
        return [ChunkedKVCache(64) for _ in self.inner.layers]  # type: ignore[attr-defined]

    def parameters(self) -> object:
        return self.inner.parameters()  # type: ignore[attr-defined]


def test_engine_refuses_at_load_a_cache_it_cannot_store(tiny_llama_path):
    model, tok = load(str(tiny_llama_path))
    with pytest.raises(ValueError, match="^model m: unsupported cache type for block storage: "
                       "ChunkedKVCache"):
        Engine(_ChunkedModel(model), tok, model_id="m", fingerprint="f", context_length=4096,
               vocab_size=1024, cache=make_cache())


class _MixedDtypeModel:
    """A one-layer model whose KV cache gets float32 keys and float16 values."""

    layers = [None]

    def make_cache(self) -> list[object]:
        return [KVCache()]

    def __call__(self, inputs: mx.array, cache: list[KVCache] | None = None) -> mx.array:
        n = inputs.shape[1]
        if cache is not None:
            cache[0].update_and_fetch(mx.zeros((1, 1, n, 64)),
                                      mx.zeros((1, 1, n, 16), dtype=mx.float16))
        return mx.zeros((1, n, 1024))

    def parameters(self) -> dict[str, mx.array]:
        return {}


def test_engine_refuses_at_load_a_state_that_does_not_round_trip(tiny_llama_path):
    _, tok = load(str(tiny_llama_path))
    kw = {"model_id": "mixed", "fingerprint": "f", "context_length": 4096, "vocab_size": 1024}
    with pytest.raises(ValueError, match=r"^model mixed: this model's cache cannot be stored in "
                       r"blocks: layer 0: keys are mlx.core.float32, values mlx.core.float16"):
        Engine(_MixedDtypeModel(), tok, cache=make_cache(), **kw)
    Engine(_MixedDtypeModel(), tok, cache=None, **kw).close()  # nothing to store: loads


# ---------------------------------------------------------------- the models


def test_cache_shapes_per_layer(mla):
    kind, path = mla
    model, _ = load(str(path))
    caches = make_prompt_cache(model)
    types = {"deepseek_v3": [KVCache] * 3, "glm4_moe_lite": [KVCache] * 3,
             "deepseek_v32": [CacheList] * 3,
             "kimi_linear": [ArraysCache, ArraysCache, ArraysCache, KVCache, ArraysCache]}
    assert [type(c) for c in caches] == types[kind]
    model(mx.array([_prompt(kind, 5)]), cache=caches)
    mla_leaves = [c.caches[0] if isinstance(c, CacheList) else c
                  for c in caches if not isinstance(c, ArraysCache)]
    for c in mla_leaves:
        k, v, offset = c.state
        assert (offset, k.shape[-1], v.shape[-1]) == (5, KV_LORA_RANK, ROPE_DIM)


def _states(layer: int) -> list[str]:
    """kimi_linear's linear-attention state: three short-conv states and the SSM state."""
    return [*(f"{layer}=s{j}:float32:1x3x64" for j in range(3)), f"{layer}=s3:float32:1x4x16x16"]


def _expected_layout(kind: str, n: int, snapshot: bool) -> str:
    mla_item = MLA_ITEM.format(n=n)
    if kind == "deepseek_v32":
        return ";".join(f"{i}.0={mla_item};{i}.1=kv:float32:1x1x{n}x32" for i in range(3))
    if kind == "kimi_linear":
        kv = f"3={mla_item}"
        return ";".join([*_states(0), *_states(1), *_states(2), kv, *_states(4)]) if snapshot else kv
    return f"0-2={mla_item}"


# (start, tokens, bytes) of the blocks a 30-token prompt and 4 generated tokens store:
# the prompt [0,8) [8,16) [16,24) [24,30), then prompt + output[:-1] to 33: [24,32)
# supersedes [24,30) where the KV can be cut, and [32,33). MLA KV per token and layer:
# 64 + 16 floats (320 bytes); the deepseek_v32 indexer adds 32 + 32; a kimi_linear
# snapshot holds 4 x (3 x 768 + 4096) bytes of state.
_MLA = [(0, 8, 7680), (8, 8, 7680), (16, 8, 7680), (24, 8, 7680), (32, 1, 960)]
EXPECTED_BLOCKS = {
    "deepseek_v3": _MLA, "glm4_moe_lite": _MLA,
    "deepseek_v32": [(0, 8, 13824), (8, 8, 13824), (16, 8, 13824), (24, 8, 13824), (32, 1, 1728)],
    "kimi_linear": [(0, 8, 2560), (8, 8, 28160), (16, 8, 2560), (24, 6, 27520), (24, 8, 2560),
                    (32, 1, 25920)],
}


def test_blocks_restore_from_ram_and_equal_a_full_prefill(mla):
    kind, path = mla
    prompt = _prompt(kind)
    with _engine(path) as eng:
        r1 = eng.generate(prompt, max_tokens=MAX_TOKENS)
        assert r1.finish_reason == "length"
        assert eng.stats()["engine"]["store_errors"] == 0
        assert eng.cache is not None
        blocks = sorted(eng.cache.pool.blocks(), key=lambda b: (b.start, b.num_tokens))
        assert [(b.start, b.num_tokens, b.nbytes) for b in blocks] == EXPECTED_BLOCKS[kind]
        for b in blocks:  # snapshots: end of the first chunk, of the prompt, of the reply
            snap = b.start + b.num_tokens in (16, 30, 33)
            assert b.payload.layout.text == _expected_layout(kind, b.num_tokens, snap), b.start

        r2 = eng.generate(prompt, max_tokens=MAX_TOKENS)
        ref = eng.generate(prompt, max_tokens=MAX_TOKENS, use_cache=False)
        assert r2.usage.cached_tokens == REPEAT_HIT[kind]
        assert r2.usage.cached_by_tier == {"ram": REPEAT_HIT[kind]}
        assert r2.tokens == r1.tokens == ref.tokens

        # the second turn: the prompt, the reply and a new user message
        turn2 = prompt + r1.tokens + _prompt(kind, 7, seed=1)[1:]
        t2 = eng.generate(turn2, max_tokens=MAX_TOKENS)
        assert t2.usage.cached_tokens == PROMPT_LEN + MAX_TOKENS - 1  # prompt + output[:-1]
        assert t2.tokens == eng.generate(turn2, max_tokens=MAX_TOKENS, use_cache=False).tokens
        assert eng.stats()["engine"]["store_errors"] == 0
        assert eng.stats()["engine"]["restore_errors"] == 0


def test_blocks_restore_from_ssd_after_a_restart(mla, tmp_path):
    kind, path = mla
    prompt = _prompt(kind, seed=5)
    ssd = SSDConfig(path=tmp_path / "blocks", policy="write_through", fsync=False)
    cc = CacheConfig(block_size=BLOCK, ram_budget_bytes=64 * 1024**2)
    with _engine(path, build_cache(cc, ssd)) as first:
        r1 = first.generate(prompt, max_tokens=MAX_TOKENS)
        assert r1.finish_reason == "length"  # no early EOS: the reply's blocks exist
        assert first.stats()["engine"]["store_errors"] == 0
    with _engine(path, build_cache(cc, ssd)) as second:
        r2 = second.generate(prompt, max_tokens=MAX_TOKENS)
        turn2 = prompt + r1.tokens + _prompt(kind, 5, seed=3)[1:]
        t2 = second.generate(turn2, max_tokens=MAX_TOKENS)
        ref = second.generate(prompt, max_tokens=MAX_TOKENS, use_cache=False)
        ref2 = second.generate(turn2, max_tokens=MAX_TOKENS, use_cache=False)
        engine_stats = second.stats()["engine"]
    assert r2.usage.cached_by_tier == {"ssd": REPEAT_HIT[kind]}
    assert r2.tokens == r1.tokens == ref.tokens
    # the prompt's blocks are in RAM now; the reply's still on the SSD
    assert t2.usage.cached_tokens == PROMPT_LEN + MAX_TOKENS - 1
    assert t2.tokens == ref2.tokens
    assert (engine_stats["store_errors"], engine_stats["restore_errors"]) == (0, 0)


def test_batched_requests_store_restore_and_equal_each_alone(mla):
    """Rows join mlx-lm's batch caches (K and V of different widths) cold, prefilled in
    a batch of right-padded chunks (plain KV, CacheList, KDA states), and warm,
    restored from the blocks the cold batch stored; each decodes as it would alone."""
    kind, path = mla
    prompts = [_prompt(kind, n, seed=4 + n) for n in (20, 27, 35)]
    with _engine(path) as eng:
        alone = [eng.generate(p, max_tokens=6, use_cache=False).tokens for p in prompts]
        cold_st = Stepper(eng)
        cold = [cold_st.submit(p, max_tokens=6) for p in prompts]
        cold_st.run()
        st = Stepper(eng)
        runs = [st.submit(p, max_tokens=6) for p in prompts]
        st.run()
    assert [r.tokens for r in cold] == [r.tokens for r in runs] == alone
    assert [r.result.usage.cached_tokens for r in cold if r.result is not None] == [0, 0, 0]
    # all but the last token; kimi_linear: its snapshots at 16 (a chunk) and 32 (a chunk)
    hits = [16, 16, 32] if kind == "kimi_linear" else [19, 26, 34]
    assert [r.result.usage.cached_tokens for r in runs if r.result is not None] == hits
    # every kind (plain MLA KV, deepseek_v32's CacheList of KV + indexer keys, kimi_linear's
    # KDA states beside MLA KV) prefills the cold prompts' 7 chunks in 3 batched steps
    c = cold_st.ctx.counters
    assert (c.prefill_chunks, c.prefill_batches, c.max_prefill_batch, c.max_batch) == (
        7, 3, 3, 3)
    c = st.ctx.counters
    assert (c.prefill_chunks, c.prefill_batches, c.max_prefill_batch, c.max_batch) == (
        3, 1, 3, 3)
    for c in (cold_st.ctx.counters, st.ctx.counters):
        assert (c.store_errors, c.restore_errors) == (0, 0)


# ---------------------------------------------------------------- format version


def test_blocks_of_the_previous_format_version_are_never_looked_up(tmp_path):
    """Version 2 changed the layout grammar (value shapes); the version is part of every
    namespace root, so a version-1 block on the SSD is a clean miss, not a misread."""
    assert CACHE_FORMAT_VERSION == 2
    old = Namespace("mla-model", 4, kv_spec="float32;kv*1", format_version=1)
    new = Namespace("mla-model", 4, kv_spec="float32;kv*1")
    assert old.root != new.root and old.key != new.key

    def payload_for(start: int, end: int, snapshot: bool) -> BlockPayload:
        k = mx.full((1, 1, end - start, 4), float(start))
        return pack([(Item("0", "kv", "float32", tuple(k.shape)), [k, -k])])

    cfg = CacheConfig(block_size=4, ram_budget_bytes=1 << 20)
    cache = PromptCache(cfg, adapter=MLXPayloadAdapter(),
                        lower=[SSDTier(SSDConfig(path=tmp_path, fsync=False))], write_through=True)
    cache.store(old, [1, 2, 3, 4, 5, 6, 7, 8], 8, payload_for)
    cache.close()
    tier = SSDTier(SSDConfig(path=tmp_path, fsync=False))
    cache = PromptCache(cfg, adapter=MLXPayloadAdapter(), lower=[tier])
    miss = cache.acquire([1, 2, 3, 4, 5, 6, 7, 8, 9], new)
    assert miss.num_tokens == 0
    cache.release(miss)
    hit = cache.acquire([1, 2, 3, 4, 5, 6, 7, 8, 9], old)  # still there, untouched
    assert hit.num_tokens == 8 and hit.tokens_by_tier == {"ssd": 8}
    cache.release(hit)
    assert cache.stats().to_dict()["tiers"]["ssd"]["blocks_on_disk"] == 2
    cache.close()


def test_kv_bits_on_an_mla_model_checks_both_block_kinds(tiny_llama_path, models_root):
    """``kv_bits``: the load check runs both block kinds; the tiny MLA's rope key (16
    wide) takes no group of mx.quantize, so its blocks stay full precision (exact)."""
    path = ensure_tiny_mla("deepseek_v3", tiny_llama_path, models_root)
    cc = CacheConfig(block_size=BLOCK, ram_budget_bytes=64 * 1024**2, kv_bits=8,
                     kv_quant_min_tokens=0)
    prompt = _prompt("deepseek_v3", seed=6)
    with Engine.load(path, EngineConfig(restore_plan="load", prefill_chunk_tokens=16), cc,
                     cache=PromptCache(cc, adapter=MLXPayloadAdapter())) as eng:
        r1 = eng.generate(prompt, max_tokens=MAX_TOKENS)
        r2 = eng.generate(prompt, max_tokens=MAX_TOKENS)
        assert eng.cache is not None
        layouts = {b.payload.layout.text for b in eng.cache.pool.blocks()}
        assert eng.stats()["engine"]["store_errors"] == 0
    assert layouts == {"0-2=" + MLA_ITEM.format(n=8), "0-2=" + MLA_ITEM.format(n=1)}
    assert r2.usage.cached_tokens == PROMPT_LEN - 1 and r2.tokens == r1.tokens
    live = KVCache()
    live.update_and_fetch(mx.ones((1, 1, 1, 64)), mx.ones((1, 1, 1, 32)))
    adapters.check_storable([KVCache()], [live], 1, quant=KVQuant(8))
