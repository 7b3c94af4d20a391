"""The architecture matrix: one tiny random-weight model per family users run.

Each family is built offline from the real mlx-lm model class
(``mlx_lm.models.<model_type>``) with a config that keeps the family's structure
(sliding windows and attention sinks, MLA latents whose ``kv_lora_rank`` differs from
``qk_rope_head_dim``, linear-attention / SSM layers in the real layer pattern, MoE
routing over several experts with top-k, ``CacheList`` layers), sized tiny (hidden 64,
2-6 layers, the shared byte-level tokenizer of ``tiny_models``). The folders are normal
model folders that ``mlx_lm.load`` reads, cached under
``tiny-matrix-<family>-v<TINY_FAMILIES_VERSION>``.

Replies re-tokenize to the same ids. The output rows of the lm head (the embedding
rows when the family ties them) are scaled up for a fixed set of whole-word tokens
(``" word"``, one token each: ``word_token_ids``) and down to almost nothing for every
other token, so greedy decoding only ever picks whole words. Byte-level BPE splits
text into pre-tokens at each space, so a reply made of ``" word"`` tokens encodes to
the same ids when a client sends it back as the assistant's turn.

Each family's tokenizer is the shared one plus the special tokens of its published
chat format, and its ``tokenizer_config.json`` carries a chat template written from that
format (``family_templates``): rendering, tool calls and their parsing are the family's.

``"qwen3_4bit"`` is the qwen3 family with its weights quantized to 4 bits by mlx's
``nn.quantize`` (``config.json`` carries ``quantization`` as mlx-lm writes it).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .family_templates import BY_FAMILY, FamilyChat
from .tiny_models import (
    _WORDS,
    CONTEXT_LENGTH,
    PAD_TOKEN,
    SLIDING_WINDOW,
    VOCAB_SIZE,
    ensure_built,
    new_model_folder,
    tokenizer_json,
)

logger = logging.getLogger(__name__)

# Bump when a family's config, the weights' construction or the tokenizer changes.
TINY_FAMILIES_VERSION = 2
# rows of the embedding and the lm head: the shared vocabulary + room for the tokens a
# family's chat format adds
FAMILY_VOCAB_SIZE = VOCAB_SIZE + 64
WORD_GAIN = 4.0  # output rows of whole-word tokens are scaled by this
OTHER_GAIN = 1e-3  # ... and every other token's by this
QUANT_BITS = 4
QUANT_GROUP = 32

FAMILIES = (
    "llama", "qwen3", "qwen3_moe", "gpt_oss", "gemma3_text", "qwen3_5", "qwen3_5_moe",
    "qwen3_next", "nemotron_h", "falcon_h1", "deepseek_v3", "glm4_moe_lite", "kimi_linear",
    "qwen3_4bit",
)

# How the family writes tool calls: the format its tiny model's chat template
# (``family_templates``) asks for, as promptcache detects and parses it
# (``tests/engine/test_family_templates.py`` checks each against the loaded model).
TOOL_FORMATS: dict[str, str] = {
    "llama": "hermes / bare JSON (fallback)",
    "qwen3": "json_tools (`<tool_call>` JSON)",
    "qwen3_moe": "qwen3_coder XML (ours; Qwen3-Coder)",
    "gpt_oss": "harmony (`to=functions.NAME`)",
    "gemma3_text": "hermes (fallback: no tools in the template)",
    "qwen3_5": "qwen3_coder XML (ours)",
    "qwen3_5_moe": "qwen3_coder XML (ours)",
    "qwen3_next": "qwen3_coder XML (ours; Qwen3-Coder-Next)",
    "nemotron_h": "qwen3_coder XML (ours; Nemotron 3)",
    "falcon_h1": "json_tools (`<tool_call>` JSON)",
    "deepseek_v3": "deepseek (ours, `<｜tool▁calls▁begin｜>`)",
    "glm4_moe_lite": "glm47 (ours, `<arg_key>`)",
    "kimi_linear": "kimi_k2",
    "qwen3_4bit": "json_tools (`<tool_call>` JSON)",
}

# The structure each tiny model keeps (docs/cache.md's matrix table).
STRUCTURES: dict[str, str] = {
    "llama": "dense, GQA",
    "qwen3": "dense, QK norm",
    "qwen3_moe": "MoE 4 experts top-2",
    "gpt_oss": "sliding / full alternating, attention sinks, MoE 4 top-2",
    "gemma3_text": "sliding window 16 (5:1 pattern cut to 2:1)",
    "qwen3_5": "gated delta net x3 + attention",
    "qwen3_5_moe": "gated delta net x3 + attention, MoE 4 top-2 + shared",
    "qwen3_next": "gated delta net x3 + attention, MoE 4 top-2 + shared",
    "nemotron_h": "Mamba2, attention, MoE, Mamba2",
    "falcon_h1": "Mamba2 and attention in parallel in every layer",
    "deepseek_v3": "MLA (latent 32, rope 8), dense + MoE 4 top-2 + shared",
    "glm4_moe_lite": "MLA (latent 32, rope 8), dense + MoE 4 top-2 + shared",
    "kimi_linear": "KDA x3 + MLA, MoE 4 top-2 + shared",
    "qwen3_4bit": "qwen3 with 4-bit weights (`nn.quantize`, group 32)",
}

_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
_MLA = {  # latent width (kv_lora_rank) != rope key width (qk_rope_head_dim)
    "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
    "v_head_dim": 16,
}


def _llama(_: dict[str, Any]) -> dict[str, Any]:
    return {"model_type": "llama", "num_hidden_layers": 2, "rope_theta": 10000.0}


def _qwen3(_: dict[str, Any]) -> dict[str, Any]:
    return {"model_type": "qwen3", "num_hidden_layers": 2, "rope_theta": 1_000_000.0}


def _qwen3_moe(_: dict[str, Any]) -> dict[str, Any]:
    return {"model_type": "qwen3_moe", "num_hidden_layers": 2, "rope_theta": 1_000_000.0,
            **_MOE, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}


def _gpt_oss(_: dict[str, Any]) -> dict[str, Any]:
    # alternating sliding (window 16) / full attention, attention sinks, 4 experts top-2
    return {"model_type": "gpt_oss", "num_hidden_layers": 4, "num_local_experts": 4,
            "num_experts_per_tok": 2, "intermediate_size": 64,
            "sliding_window": SLIDING_WINDOW, "rope_theta": 150000,
            "layer_types": ["sliding_attention", "full_attention"] * 2}


def _gemma3_text(_: dict[str, Any]) -> dict[str, Any]:
    # [Rotating, Rotating, KV] x 2, window 16
    return {"model_type": "gemma3_text", "num_hidden_layers": 6, "rms_norm_eps": 1e-6,
            "query_pre_attn_scalar": 16, "sliding_window": SLIDING_WINDOW,
            "sliding_window_pattern": 3, "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0}


def _qwen3_5(_: dict[str, Any]) -> dict[str, Any]:
    # gated delta net x3 + full attention (full_attention_interval 4)
    return {"model_type": "qwen3_5", "num_hidden_layers": 4, "full_attention_interval": 4,
            "linear_num_value_heads": 4, "linear_num_key_heads": 2,
            "linear_key_head_dim": 16, "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
            "rope_parameters": {"type": "default", "mrope_section": [1, 1, 0],
                                "rope_theta": 100000, "partial_rotary_factor": 0.25}}


def _qwen3_5_moe(c: dict[str, Any]) -> dict[str, Any]:
    return {**_qwen3_5(c), "model_type": "qwen3_5_moe", **_MOE,
            "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1}


def _qwen3_next(_: dict[str, Any]) -> dict[str, Any]:
    return {"model_type": "qwen3_next", "num_hidden_layers": 4, "full_attention_interval": 4,
            "linear_num_value_heads": 4, "linear_num_key_heads": 2,
            "linear_key_head_dim": 16, "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4, **_MOE, "decoder_sparse_step": 1,
            "shared_expert_intermediate_size": 32, "mlp_only_layers": [],
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
            "norm_topk_prob": True}


def _nemotron_h(_: dict[str, Any]) -> dict[str, Any]:
    # Mamba2, attention, MoE, Mamba2 (the Nemotron 3 layer kinds)
    return {"model_type": "nemotron_h", "hybrid_override_pattern": ["M", "*", "E", "M"],
            "attention_bias": False, "mamba_num_heads": 4, "mamba_head_dim": 16,
            "mamba_proj_bias": False, "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 1,
            "mlp_bias": False, "layer_norm_epsilon": 1e-5, "use_bias": False,
            "use_conv_bias": True, "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 32, "n_routed_experts": 4,
            "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
            "norm_topk_prob": True, "routed_scaling_factor": 1.0}


def _falcon_h1(_: dict[str, Any]) -> dict[str, Any]:
    # every layer a CacheList(ArraysCache (Mamba2), KVCache (attention)) in parallel
    return {"model_type": "falcon_h1", "num_hidden_layers": 2, "mamba_d_ssm": 64,
            "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16,
            "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 1,
            "mamba_chunk_size": 16, "rope_theta": 10000.0}


def _deepseek_v3(_: dict[str, Any]) -> dict[str, Any]:
    # MLA; layer 0 dense, layer 1 MoE (4 routed top-2, 1 shared)
    return {"model_type": "deepseek_v3", "num_hidden_layers": 2, **_MLA,
            "num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
            "routed_scaling_factor": 1.0, "rope_theta": 10000.0}


def _glm4_moe_lite(c: dict[str, Any]) -> dict[str, Any]:
    return {**_deepseek_v3(c), "model_type": "glm4_moe_lite", "partial_rotary_factor": 1.0,
            "num_nextn_predict_layers": 0}


def _kimi_linear(_: dict[str, Any]) -> dict[str, Any]:
    # KDA (linear) x3 + MLA, the real 3:1 pattern; MoE 4 experts top-2 after layer 0
    return {"model_type": "kimi_linear", "num_hidden_layers": 4, "model_max_length": 4096,
            "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4],
                                   "num_heads": 4, "head_dim": 16,
                                   "short_conv_kernel_size": 4},
            "num_experts": 4, "num_experts_per_token": 2, "num_shared_experts": 1,
            "moe_intermediate_size": 32, "first_k_dense_replace": 1, "kv_lora_rank": 32,
            "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
            "num_key_value_heads": 4, "rope_theta": 10000.0, "bos_token_id": None}


_CONFIGS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "llama": _llama, "qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "gpt_oss": _gpt_oss,
    "gemma3_text": _gemma3_text, "qwen3_5": _qwen3_5, "qwen3_5_moe": _qwen3_5_moe,
    "qwen3_next": _qwen3_next, "nemotron_h": _nemotron_h, "falcon_h1": _falcon_h1,
    "deepseek_v3": _deepseek_v3, "glm4_moe_lite": _glm4_moe_lite,
    "kimi_linear": _kimi_linear, "qwen3_4bit": _qwen3,
}


def _check(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; expected one of {FAMILIES}")


def family_chat(family: str) -> FamilyChat:
    """The chat format (template, added tokens) of ``family``'s tiny model."""
    _check(family)
    return BY_FAMILY[family]


@functools.cache
def family_tokenizer_json(family: str) -> str:
    """The shared tokenizer plus the tokens of ``family``'s chat format (ids from
    ``VOCAB_SIZE`` on, in the order ``FamilyChat`` lists them)."""
    from tokenizers import AddedToken, Tokenizer

    chat = family_chat(family)
    tok = Tokenizer.from_str(tokenizer_json())
    have = set(tok.get_vocab(with_added_tokens=True))
    for content in (*chat.added, *chat.plain):
        if content in have:
            continue
        token = AddedToken(content, special=content in chat.added, normalized=False)
        if content in chat.added:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
        have.add(content)
    if tok.get_vocab_size(with_added_tokens=True) > FAMILY_VOCAB_SIZE:
        raise RuntimeError(f"{family}: {tok.get_vocab_size()} tokens exceed {FAMILY_VOCAB_SIZE}")
    return str(tok.to_str())


def family_special_ids(family: str) -> dict[str, int]:
    """Every added token of ``family``'s tokenizer -> its id."""
    tok = json.loads(family_tokenizer_json(family))
    return {t["content"]: int(t["id"]) for t in tok["added_tokens"]}


def family_tokenizer_config(family: str) -> dict[str, Any]:
    """``tokenizer_config.json``: the added tokens (special as the format marks them), the
    family's BOS / EOS and its chat template."""
    chat = family_chat(family)
    tok = json.loads(family_tokenizer_json(family))
    added = {
        str(t["id"]): {"content": t["content"], "lstrip": False, "normalized": False,
                       "rstrip": False, "single_word": False, "special": bool(t["special"])}
        for t in tok["added_tokens"]
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": chat.bos,
        "eos_token": chat.eos[0],
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": CONTEXT_LENGTH,
        "chat_template": chat.template,
    }


def family_config(family: str, special_ids: dict[str, int] | None = None) -> dict[str, Any]:
    """The config.json of the tiny model of ``family`` (``special_ids``: its tokenizer's,
    read from it when not given)."""
    _check(family)
    ids = special_ids if special_ids is not None else family_special_ids(family)
    eos = [ids[t] for t in family_chat(family).eos]
    common: dict[str, Any] = {
        "vocab_size": FAMILY_VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": CONTEXT_LENGTH, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": ids[PAD_TOKEN], "torch_dtype": "float32",
    }
    config = {**common, **_CONFIGS[family](common)}
    if family == "qwen3_4bit":
        config["quantization"] = {"group_size": QUANT_GROUP, "bits": QUANT_BITS}
    return config


@functools.lru_cache(maxsize=1)
def word_token_ids() -> tuple[int, ...]:
    """The whole-word tokens the matrix models reply with: ``" word"`` for the lowercase
    words of the tokenizer's training text that are one token (sorted ids)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json())
    ids = set()
    for w in _WORDS:
        if w.isalpha() and w.islower():
            enc = tok.encode(" " + w).ids
            if len(enc) == 1:
                ids.add(int(enc[0]))
    return tuple(sorted(ids))


def _output_key(weights: dict[str, Any]) -> str:
    """The name of the lm head's weight (the embedding's when the family ties them)."""
    for suffix in ("lm_head.weight", "embed_tokens.weight"):
        keys = [k for k in weights if k.endswith(suffix)]
        if len(keys) == 1:
            return keys[0]
    raise ValueError("no lm head or token embedding found")


def _favour_words(weights: dict[str, Any]) -> dict[str, Any]:
    import mlx.core as mx

    key = _output_key(weights)
    w = weights[key]
    gain = [OTHER_GAIN] * int(w.shape[0])
    for t in word_token_ids():
        gain[t] = WORD_GAIN
    weights[key] = w * mx.array(gain, dtype=w.dtype)[:, None]
    return weights


def _randomize_zero_params(weights: dict[str, Any], seed: int) -> dict[str, Any]:
    """Parameters the model class initialises to zeros (attention sinks, gpt-oss expert
    biases, router score corrections) get small random values, so they take part."""
    import mlx.core as mx

    key = mx.random.key(seed)
    out = {}
    for name, w in weights.items():
        if mx.issubdtype(w.dtype, mx.floating) and w.ndim <= 2 \
                and not name.endswith("norm.weight") and not bool(mx.any(w != 0).item()):
            key, sub = mx.random.split(key)
            w = 0.1 * mx.random.normal(w.shape, key=sub).astype(w.dtype)
        out[name] = w
    return out


def build_family_model(family: str, out_dir: str | os.PathLike[str],
                       overrides: dict[str, Any] | None = None) -> Path:
    """Write the tiny model of ``family`` into ``out_dir`` (created; must be empty).

    ``overrides``: config.json entries that replace the family's (e.g. ``head_dim`` 64,
    which mx.quantize's groups divide, for the KV quantization tests)."""
    _check(family)
    import mlx.core as mx
    from mlx.nn.layers.quantized import quantize
    from mlx.utils import tree_flatten

    from promptcache.engine.mlx_compat import model_classes

    out, _, _ = new_model_folder(out_dir)
    tok_text = family_tokenizer_json(family)
    config = {**family_config(family), **(overrides or {})}

    model_cls, args_cls = model_classes(config["model_type"])
    seed = 2000 + FAMILIES.index(family)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    weights = {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())}
    weights = _favour_words(_randomize_zero_params(weights, seed))
    if "quantization" in config:
        model.load_weights(list(weights.items()))
        quantize(model, group_size=QUANT_GROUP, bits=QUANT_BITS)
        weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "tokenizer.json").write_text(tok_text)
    (out / "tokenizer_config.json").write_text(
        json.dumps(family_tokenizer_config(family), indent=2, ensure_ascii=False) + "\n")
    chat = family_chat(family)
    special = {"eos_token": chat.eos[0], "pad_token": PAD_TOKEN}
    if chat.bos:
        special["bos_token"] = chat.bos
    (out / "special_tokens_map.json").write_text(
        json.dumps(special, indent=2, ensure_ascii=False) + "\n")
    logger.info("built tiny %s model in %s (%d tensors)", family, out, len(weights))
    return out


def family_dirname(family: str) -> str:
    return f"tiny-matrix-{family}-v{TINY_FAMILIES_VERSION}"


def ensure_family_model(family: str, cache_root: str | os.PathLike[str]) -> Path:
    """``cache_root/tiny-matrix-<family>-v<N>``, built first if it does not exist."""
    _check(family)
    return ensure_built(Path(cache_root) / family_dirname(family),
                        lambda tmp: build_family_model(family, tmp))
