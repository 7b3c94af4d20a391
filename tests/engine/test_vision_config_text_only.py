"""A checkpoint that ships a ``vision_config`` but no image processor (Qwen3.5 laid out
as it ships: ``text_config`` + ``vision_config``, language weights under
``model.language_model``, vision weights under ``model.visual``, but no
``preprocessor_config.json``) loads text-only through mlx-lm, says so and why in the
log, and caches like any text model. (With its image processor, Qwen3.5 takes images
through mlx-vlm: tests/vlm/test_vlm_families.py.)"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from promptcache.cache import PromptCache
from promptcache.config import CacheConfig
from promptcache.engine.engine import Engine
from promptcache.engine.models.loader import load_model_or_vlm
from promptcache.engine.payload.payload import MLXPayloadAdapter
from promptcache.serving_config import EngineConfig

TEXT_CONFIG = {
    "model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "full_attention_interval": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "linear_num_value_heads": 4,
    "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "rope_parameters": {"type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.5},
}
VISION_CONFIG = {"model_type": "qwen3_5", "depth": 2, "hidden_size": 32, "num_heads": 2,
                 "patch_size": 16, "out_hidden_size": 64, "in_channels": 3}


def _build_qwen3_5(base: Path, out: Path) -> Path:
    """A tiny Qwen3.5 checkpoint laid out as it ships (the tiny llama's tokenizer)."""
    from promptcache.engine.mlx_compat import model_classes

    base_config = json.loads((base / "config.json").read_text())
    text = {**TEXT_CONFIG, "vocab_size": base_config["vocab_size"],
            "eos_token_id": base_config["eos_token_id"]}
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": text, "vision_config": VISION_CONFIG,
              "image_token_id": 5, "eos_token_id": base_config["eos_token_id"],
              "pad_token_id": base_config["pad_token_id"], "tie_word_embeddings": False}
    model_cls, args_cls = model_classes("qwen3_5")
    mx.random.seed(35)
    model = model_cls(args_cls.from_dict(config))
    from mlx.utils import tree_flatten

    weights = {}
    for name, w in tree_flatten(model.parameters()):
        if name.startswith("language_model.model."):  # the checkpoint's own names
            name = "model.language_model." + name.removeprefix("language_model.model.")
        elif name.startswith("language_model."):
            name = name.removeprefix("language_model.")
        weights[name] = w.astype(mx.float32)
    weights["model.visual.patch_embed.proj.weight"] = mx.random.normal((32, 3, 2, 16, 16))
    weights["model.visual.merger.linear_fc2.weight"] = mx.random.normal((64, 32))
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for f in base.iterdir():
        if f.name not in ("config.json", "model.safetensors") and f.is_file():
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def qwen3_5_path(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_qwen3_5(tiny_llama_path, tmp_path_factory.mktemp("qwen3_5") / "model")


def test_loads_text_only_through_mlx_lm_and_says_so(qwen3_5_path, caplog):
    with caplog.at_level(logging.INFO, logger="promptcache.engine.models.loader"):
        model, _tok, info, tower = load_model_or_vlm(qwen3_5_path)
    assert tower is None and info.model_type == "qwen3_5" and info.num_layers == 4
    assert info.context_length == 4096
    assert any("ships a vision_config" in r.getMessage() and "'qwen3_5'" in r.getMessage()
               and "no image processor (preprocessor_config.json)" in r.getMessage()
               and "text-only through mlx-lm" in r.getMessage() for r in caplog.records)
    caches = make_prompt_cache(model)
    assert [type(c) for c in caches] == [ArraysCache, KVCache, ArraysCache, KVCache]
    logits = model(mx.array([[10, 20, 30]]), cache=caches)
    assert logits.shape == (1, 3, 1024) and mx.isfinite(logits).all().item()


def test_a_family_neither_path_has_is_refused_with_the_vision_message(qwen3_5_path, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(qwen3_5_path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "qwen9_vl"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'qwen9_vl' is not supported yet"):
        load_model_or_vlm(folder)


def test_text_only_engine_caches_and_equals_a_full_prefill(qwen3_5_path):
    cache = PromptCache(CacheConfig(block_size=8, ram_budget_bytes=64 * 1024**2),
                        adapter=MLXPayloadAdapter())
    prompt = [int(t) for t in np.random.default_rng(35).integers(3, 1000, size=30)]
    with Engine.load(qwen3_5_path, EngineConfig(prefill_chunk_tokens=16, snapshot_every_blocks=1),
                     CacheConfig(block_size=8, ram_budget_bytes=64 * 1024**2),
                     cache=cache) as eng:
        assert eng.vision is None
        r1 = eng.generate(prompt, max_tokens=4)
        r2 = eng.generate(prompt, max_tokens=4)
        ref = eng.generate(prompt, max_tokens=4, use_cache=False)
        turn2 = prompt + r1.tokens + [7, 8, 9]
        t2 = eng.generate(turn2, max_tokens=4)
        ref2 = eng.generate(turn2, max_tokens=4, use_cache=False)
        stats = eng.stats()["engine"]
    assert r1.finish_reason == "length"
    assert r2.usage.cached_tokens == 16  # hybrid: the snapshot at the end of the first chunk
    assert r2.tokens == r1.tokens == ref.tokens
    assert t2.usage.cached_tokens == 33  # prompt + output[:-1]
    assert t2.tokens == ref2.tokens
    assert (stats["store_errors"], stats["restore_errors"]) == (0, 0)
