"""Offline test models: tiny models, their tokenizer, loading and fingerprints."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache
from models import tiny_models
from models.tiny_models import (
    SLIDING_WINDOW,
    VOCAB_SIZE,
    build_tiny_model,
    ensure_tiny_model,
)

from promptcache.engine.models.loader import (
    context_length_from_config,
    load_model,
    model_fingerprint,
    resolve_model_path,
)

EXPECTED_CACHES = {
    "llama": [KVCache, KVCache],
    "gemma3_text": [RotatingKVCache, RotatingKVCache, KVCache] * 2,
    "hybrid": [ArraysCache, KVCache, ArraysCache, KVCache],
}

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": [{"type": "text", "text": "And Italy?"}]},
]
CHAT_RENDERED = (
    "<|im_start|>system\nBe brief.<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\nParis.<|im_end|>\n"
    "<|im_start|>user\nAnd Italy?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_tiny_model_loads_and_gives_finite_logits(tiny_kind_and_path: tuple[str, Path]) -> None:
    kind, path = tiny_kind_and_path
    model, tok = load(str(path))
    ids = tok.encode("Hello world, what is the capital of France?")
    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)
    assert logits.shape == (1, len(ids), VOCAB_SIZE)
    assert logits.dtype == mx.float32
    assert mx.isfinite(logits).all().item()
    # random weights, but not degenerate: the logits differ across the vocabulary
    assert logits[0, -1].std().item() > 0.1
    assert all(c.offset == len(ids) for c in cache if not isinstance(c, ArraysCache))


def test_tiny_model_cache_types_per_layer(tiny_kind_and_path: tuple[str, Path]) -> None:
    kind, path = tiny_kind_and_path
    model, _ = load(str(path))
    caches = make_prompt_cache(model)
    assert [type(c) for c in caches] == EXPECTED_CACHES[kind]
    for c in caches:
        if isinstance(c, RotatingKVCache):
            assert c.max_size == SLIDING_WINDOW
            assert c.keep == 0


def test_gemma_sliding_window_actually_slides(tiny_gemma_path: Path) -> None:
    model, tok = load(str(tiny_gemma_path))
    caches = make_prompt_cache(model)
    model(mx.array([list(range(10, 50))]), cache=caches)  # 40 tokens > window 16
    model(mx.array([[7]]), cache=caches)
    rot, full = caches[0], caches[2]
    assert rot.offset == 41 and full.offset == 41
    assert rot.keys.shape[2] == SLIDING_WINDOW  # only the window is kept
    assert full.keys.shape[2] >= 41


def test_hybrid_ssm_state_is_filled(tiny_hybrid_path: Path) -> None:
    model, tok = load(str(tiny_hybrid_path))
    caches = make_prompt_cache(model)
    model(mx.array([tok.encode("one two three four five")]), cache=caches)
    conv, ssm = caches[0][0], caches[0][1]
    # nemotron_h Mamba2: conv state (batch, kernel-1, conv_dim), ssm state (batch, heads, head_dim, state)
    assert conv.shape == (1, 3, 4 * 16 + 2 * 16)
    assert ssm.shape == (1, 4, 16, 16)
    assert mx.isfinite(ssm).all().item()


def test_tokenizer_round_trips_and_knows_special_tokens(tiny_llama_path: Path) -> None:
    _, tok = load(str(tiny_llama_path))
    for text in [
        "What is the capital of France?",
        "  leading spaces, tabs\tand\nnewlines\r\n",
        "unicode: é ü 中文 🙂 \u200b",
        "def f(x):\n    return {'a': [1, 2.5e-3]}\n",
        "",
    ]:
        ids = tok.encode(text, add_special_tokens=False)
        assert all(0 <= i < VOCAB_SIZE for i in ids)
        assert tok.decode(ids) == text
    vocab = tok.get_vocab()
    ids = tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)
    assert ids[0] == vocab["<|im_start|>"] and ids[-1] == vocab["<|im_end|>"]
    assert len(ids) == 3  # each special token is one id; "user" is one learned token
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_ids == {vocab["<|im_end|>"]}


def test_chat_template_renders_chatml(tiny_llama_path: Path) -> None:
    _, tok = load(str(tiny_llama_path))
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text == CHAT_RENDERED
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True)
    assert tok.decode(ids) == CHAT_RENDERED
    tools = [{"type": "function", "function": {"name": "f"}}]
    with_tools = tok.apply_chat_template(CHAT[1:2], tools=tools, tokenize=False)
    assert with_tools.startswith("<|im_start|>system\n# Tools\n")
    assert '"name": "f"' in with_tools


def test_build_is_deterministic(tmp_path: Path, tiny_llama_path: Path) -> None:
    out = build_tiny_model("llama", tmp_path / "again")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (tiny_llama_path / name).read_bytes(), name


def test_ensure_is_idempotent_and_replaces_half_built(tmp_path: Path) -> None:
    first = ensure_tiny_model("llama", tmp_path)
    assert first == tmp_path / f"tiny-llama-v{tiny_models.TINY_MODELS_VERSION}"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model("llama", tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temp folders left
    # a folder left without config.json (never finished) is rebuilt
    (first / "config.json").unlink()
    assert ensure_tiny_model("llama", tmp_path) == first
    assert json.loads((first / "config.json").read_text())["model_type"] == "llama"
    shutil.rmtree(first)


def test_bad_kind_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny model kind 'gpt5'"):
        ensure_tiny_model("gpt5", tmp_path)
    with pytest.raises(ValueError, match="unknown tiny model kind"):
        build_tiny_model("gpt5", tmp_path / "x")


def test_build_refuses_non_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "junk.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        build_tiny_model("llama", tmp_path)


# --- loader and fingerprint -------------------------------------------------------


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_load_model_info(tiny_hybrid_path: Path) -> None:
    model, tok, info = load_model(tiny_hybrid_path)
    assert info.model_id == tiny_hybrid_path.name
    assert info.path == tiny_hybrid_path.resolve()
    assert info.model_type == "nemotron_h"
    assert info.context_length == tiny_models.CONTEXT_LENGTH
    assert info.dtype == "float32"
    assert info.num_layers == 4
    assert info.fingerprint == model_fingerprint(tiny_hybrid_path)
    assert tok.decode(tok.encode("abc", add_special_tokens=False)) == "abc"


def test_load_model_casts_half_precision_weights_to_float32_on_cpu(
    tmp_path: Path, tiny_llama_path: Path
) -> None:
    half = _copy_model(tiny_llama_path, tmp_path / "half")
    weights = mx.load(str(half / "model.safetensors"))
    mx.save_safetensors(
        str(half / "model.safetensors"), {k: v.astype(mx.bfloat16) for k, v in weights.items()}
    )
    assert mx.default_device() == mx.cpu
    model, _, info = load_model(half)
    assert info.dtype == "float32"
    assert model.model.embed_tokens.weight.dtype == mx.float32
    _, _, kept = load_model(half, float32_on_cpu=False)
    assert kept.dtype == "bfloat16"


def test_fingerprint_is_stable_and_sees_config_and_weight_changes(
    tmp_path: Path, tiny_llama_path: Path
) -> None:
    base = model_fingerprint(tiny_llama_path)
    assert len(base) == 64
    copy = _copy_model(tiny_llama_path, tmp_path / "copy")
    assert model_fingerprint(copy) == base  # same content elsewhere: same fingerprint
    # reformatting config.json does not matter, changing a value does
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(cfg, indent=4))
    assert model_fingerprint(copy) == base
    (copy / "config.json").write_text(json.dumps({**cfg, "rope_theta": 500000.0}))
    assert model_fingerprint(copy) != base
    (copy / "config.json").write_text(json.dumps(cfg))
    # one changed weight value (same header, same size) changes it
    path = copy / "model.safetensors"
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    data[8 + header_len : 8 + header_len + 4] = struct.pack("<f", 12.5)
    path.write_bytes(bytes(data))
    assert path.stat().st_size == (tiny_llama_path / "model.safetensors").stat().st_size
    assert model_fingerprint(copy) != base
    # tiny models of other kinds differ
    assert len({base, model_fingerprint(ensure_tiny_model("hybrid", tiny_llama_path.parent))}) == 2


def test_bad_model_paths_are_value_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="empty"):
        resolve_model_path("  ")
    with pytest.raises(ValueError, match="not a model folder"):
        resolve_model_path(tmp_path)
    with pytest.raises(ValueError, match="neither an existing folder nor a Hugging Face repo id"):
        resolve_model_path("./no/such/folder")
    with pytest.raises(ValueError, match="not a model folder"):
        model_fingerprint(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        model_fingerprint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no .safetensors"):
        model_fingerprint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 8 + b"x")
    with pytest.raises(ValueError, match="not a safetensors file"):
        model_fingerprint(tmp_path)


def test_context_length_from_config() -> None:
    assert context_length_from_config({"max_position_embeddings": 8192}) == 8192
    assert context_length_from_config({"text_config": {"max_position_embeddings": 2048}}) == 2048
    assert context_length_from_config({"n_ctx": 1024}) == 1024
    assert context_length_from_config({}) == 4096
    assert context_length_from_config({"max_position_embeddings": None}, default=77) == 77


def test_model_info_cli(capsys: pytest.CaptureFixture[str], tiny_llama_path: Path, tmp_path: Path) -> None:
    from promptcache.cli import main as cli_main

    assert cli_main(["model", "info", str(tiny_llama_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"path: {tiny_llama_path.resolve()}",
        "model_type: llama",
        f"context_length: {tiny_models.CONTEXT_LENGTH}",
        f"fingerprint: {model_fingerprint(tiny_llama_path)}",
    ]
    assert cli_main(["model", "info", str(tmp_path)]) == 2
    assert "is not a model folder" in capsys.readouterr().err
