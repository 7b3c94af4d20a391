"""Tiny random-weight MLA models (multi-head latent attention) for the MLA cache tests.

MLA caches the compressed latent as the KV cache's "keys" and the rope key as its
"values": two arrays of different widths (``kv_lora_rank`` and ``qk_rope_head_dim``,
512 and 64 in the real DeepSeek-V3). These configs keep the real structure at a tiny
size: ``kv_lora_rank`` (64) != ``qk_rope_head_dim`` (16), a low-rank query
(deepseek_v3, glm4_moe_lite), routed MoE with shared experts and grouped top-k routing
after dense first layers; kimi_linear mixes linear-attention layers (gated delta net,
``ArraysCache``) with MLA layers (``KVCache``), and deepseek_v32 holds per layer a
``CacheList`` of the MLA cache and its sparse-attention indexer's cache. The MoE gates of
deepseek_v3 / glm4_moe_lite start at zero in mlx-lm (every expert ties); they get
random weights here so routing actually picks experts per token.

Each folder shares the tiny models' tokenizer (copied from the tiny llama folder) and
is built once under the test models root, like ``quant_models``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import save_beside
from .tiny_models import ensure_built

KINDS = ("deepseek_v3", "glm4_moe_lite", "kimi_linear", "deepseek_v32")
VERSION = 1
KV_LORA_RANK = 64
ROPE_DIM = 16

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": KV_LORA_RANK,
    "qk_rope_head_dim": ROPE_DIM,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

_DEEPSEEK_MOE: dict[str, Any] = {
    "q_lora_rank": 48,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 2.5,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "n_group": 2,
    "topk_group": 1,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "num_hidden_layers": 3,
}


def model_config(kind: str, base: dict[str, Any]) -> dict[str, Any]:
    """The config.json of the tiny ``kind`` (vocabulary and special ids from ``base``,
    the tiny llama's config)."""
    common = {**_COMMON, "vocab_size": base["vocab_size"],
              "eos_token_id": base["eos_token_id"], "pad_token_id": base["pad_token_id"]}
    if kind == "deepseek_v3":
        return {**common, **_DEEPSEEK_MOE, "model_type": "deepseek_v3",
                "architectures": ["DeepseekV3ForCausalLM"], "max_position_embeddings": 4096,
                "rope_scaling": {"type": "yarn", "factor": 4.0, "mscale": 1.0,
                                 "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                                 "original_max_position_embeddings": 1024}}
    if kind == "deepseek_v32":
        # each layer's cache is a CacheList: the MLA KVCache and the sparse-attention
        # indexer's KVCache (its keys; values zeros of the same shape); index_topk < the
        # prompts, so the indexer really selects
        return {**common, **_DEEPSEEK_MOE, "model_type": "deepseek_v32",
                "architectures": ["DeepseekV32ForCausalLM"], "max_position_embeddings": 4096,
                "index_head_dim": 32, "index_n_heads": 4, "index_topk": 16}
    if kind == "glm4_moe_lite":
        return {**common, **_DEEPSEEK_MOE, "model_type": "glm4_moe_lite",
                "architectures": ["Glm4MoeLiteForCausalLM"], "max_position_embeddings": 4096,
                "qk_nope_head_dim": 24, "v_head_dim": 32, "routed_scaling_factor": 1.8,
                "n_group": 1, "num_nextn_predict_layers": 1}
    if kind == "kimi_linear":
        return {**common, "model_type": "kimi_linear",
                "architectures": ["KimiLinearForCausalLM"], "model_max_length": 4096,
                "bos_token_id": base["pad_token_id"],
                "num_hidden_layers": 5, "head_dim": 16, "qk_nope_head_dim": 16,
                "v_head_dim": 16, "mla_use_nope": True, "num_experts": 8,
                "num_experts_per_token": 2, "num_shared_experts": 1,
                "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
                "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
                "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
                # three linear-attention (KDA) layers, one MLA layer, one more KDA layer
                "linear_attn_config": {"kda_layers": [1, 2, 3, 5], "full_attn_layers": [4],
                                       "num_heads": 4, "head_dim": 16,
                                       "short_conv_kernel_size": 4}}
    raise ValueError(f"unknown MLA model kind {kind!r}; expected one of {KINDS}")


def ensure_tiny_mla(kind: str, base: Path, root: Path) -> Path:
    """``root/tiny-<kind>-mla-v<N>``, built from the tiny llama folder ``base`` if missing."""
    if kind not in KINDS:
        raise ValueError(f"unknown MLA model kind {kind!r}; expected one of {KINDS}")
    return ensure_built(root / f"tiny-{kind}-mla-v{VERSION}", lambda tmp: _build(kind, base, tmp))


def _build(kind: str, base: Path, tmp: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from promptcache.engine.mlx_compat import model_classes

    config = model_config(kind, json.loads((base / "config.json").read_text()))
    model_cls, args_cls = model_classes(config["model_type"])
    mx.random.seed(2000 + KINDS.index(kind))
    model = model_cls(args_cls.from_dict(config))
    weights = {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())}
    for name, w in list(weights.items()):
        if name.endswith(".mlp.gate.weight") or name.endswith("e_score_correction_bias"):
            weights[name] = mx.random.normal(w.shape) * (0.5 if w.ndim > 1 else 0.1)
    mx.eval(weights)
    save_beside(tmp, dict(weights), config, base)
