"""A hybrid whose every layer is a ``CacheList`` of an SSM state and a KV cache
(falcon_h1: ``CacheList(ArraysCache(2), KVCache())``): its blocks name the parts
``L.0`` / ``L.1``, KV in every block and the state at snapshots; RAM and SSD hits are
exact and output from them equals a full prefill."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from models import save_beside
from models.tiny_models import ensure_built

from promptcache.cache import PromptCache
from promptcache.cli.wiring import build_cache
from promptcache.config import CacheConfig, SSDConfig
from promptcache.engine.engine import Engine
from promptcache.engine.payload.payload import MLXPayloadAdapter
from promptcache.serving_config import EngineConfig

CONFIG = {
    "model_type": "falcon_h1", "architectures": ["FalconH1ForCausalLM"], "hidden_size": 64,
    "head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
    "intermediate_size": 128, "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16,
    "mamba_d_state": 16, "mamba_chunk_size": 16, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "torch_dtype": "float32",
}
CC = CacheConfig(block_size=8, ram_budget_bytes=64 * 1024**2)


def _build(base: Path, tmp: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from promptcache.engine.mlx_compat import model_classes

    b = json.loads((base / "config.json").read_text())
    config = {**CONFIG, "vocab_size": b["vocab_size"], "eos_token_id": b["eos_token_id"],
              "pad_token_id": b["pad_token_id"]}
    model_cls, args_cls = model_classes("falcon_h1")
    mx.random.seed(7)
    model = model_cls(args_cls.from_dict(config))
    weights = {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())}
    save_beside(tmp, dict(weights), config, base)


@pytest.fixture(scope="module")
def falcon_path(tiny_llama_path: Path, models_root: Path) -> Path:
    return ensure_built(models_root / "tiny-falcon_h1-v1", lambda tmp: _build(tiny_llama_path, tmp))


def _engine(path: Path, cache: PromptCache) -> Engine:
    return Engine.load(path, EngineConfig(restore_plan="load", prefill_chunk_tokens=16, snapshot_every_blocks=1), CC,
                       cache=cache)


PROMPT = [950] + [int(t) for t in np.random.default_rng(5).integers(3, 1000, size=29)]
STATE = "{l}.0=s0:float32:1x3x96;{l}.0=s1:float32:1x4x16x16"


def _layout(n: int, snapshot: bool) -> str:
    parts = []
    for layer in (0, 1):
        if snapshot:
            parts.append(STATE.format(l=layer))
        parts.append(f"{layer}.1=kv:float32:1x2x{n}x16")
    return ";".join(parts)


def test_cachelist_hybrid_in_ram(falcon_path):
    with _engine(falcon_path, PromptCache(CC, adapter=MLXPayloadAdapter())) as eng:
        r1 = eng.generate(PROMPT, max_tokens=4)
        assert r1.finish_reason == "length"
        assert eng.cache is not None
        blocks = sorted(eng.cache.pool.blocks(), key=lambda b: (b.start, b.num_tokens))
        # snapshots at the end of the first chunk (16), the prompt (30), the reply (33)
        assert [(b.start, b.num_tokens, b.payload.layout.text) for b in blocks] == [
            (0, 8, _layout(8, False)), (8, 8, _layout(8, True)), (16, 8, _layout(8, False)),
            (24, 6, _layout(6, True)), (24, 8, _layout(8, False)), (32, 1, _layout(1, True))]
        r2 = eng.generate(PROMPT, max_tokens=4)
        assert r2.usage.cached_tokens == 16 and r2.tokens == r1.tokens
        assert r1.tokens == eng.generate(PROMPT, max_tokens=4, use_cache=False).tokens
        turn2 = PROMPT + r1.tokens + [5, 6, 7]
        t2 = eng.generate(turn2, max_tokens=4)
        assert t2.usage.cached_tokens == 33
        assert t2.tokens == eng.generate(turn2, max_tokens=4, use_cache=False).tokens
        stats = eng.stats()["engine"]
    assert (stats["store_errors"], stats["restore_errors"]) == (0, 0)


def test_cachelist_hybrid_from_ssd(falcon_path, tmp_path):
    ssd = SSDConfig(path=tmp_path / "blocks", policy="write_through", fsync=False)
    with _engine(falcon_path, build_cache(CC, ssd)) as first:
        r1 = first.generate(PROMPT, max_tokens=4)
    turn2 = PROMPT + r1.tokens + [5, 6, 7]
    with _engine(falcon_path, build_cache(CC, ssd)) as second:
        t2 = second.generate(turn2, max_tokens=4)
        ref = second.generate(turn2, max_tokens=4, use_cache=False)
    assert t2.usage.cached_by_tier == {"ssd": 33}
    assert t2.tokens == ref.tokens
