"""Tiny random-weight Gemma 3, Qwen3-VL and Qwen3.5 (dense and MoE) vision-language
models for tests, built offline from mlx-vlm's own model classes (``tiny_vlm.py``
builds the llava one).

Each folder is laid out as the real checkpoints are: ``config.json`` with the real
structure at small sizes (Gemma 3: a SigLIP tower whose patches are average-pooled to
``mm_tokens_per_image``, a gemma3_text model with sliding-window and global layers,
``boi`` / ``eoi`` / soft image tokens; Qwen3-VL: a patch-merging tower with deepstack
mergers, a qwen3 text model with interleaved M-RoPE; Qwen3.5: the Qwen3-VL tower without
deepstack and a hybrid text model, three gated-delta-net layers then one full-attention
layer with interleaved M-RoPE over part of the head, the MoE variant with 4 experts
top-2 and a shared expert), ``model.safetensors``, the image
processor's ``preprocessor_config.json``, ``processor_config.json`` and the tiny
models' tokenizer with the family's image tokens. The ChatML templates render a
``{"type": "image"}`` content part as the family's image text (Gemma 3:
``<start_of_image>``; Qwen: ``<|vision_start|><|image_pad|><|vision_end|>``).

Sizes: Gemma 3 images are 48 x 48 (12 x 12 patches pooled 2 x 2: 36 tokens); Qwen3-VL
images are resized to 48 x 48 (``sqrt(num_position_embeddings) * patch_size``), 12 x 12
patches merged 2 x 2: 36 tokens on a 6 x 6 grid (an image advances M-RoPE positions by
6, so each image moves the text after it by 6 - 36 = -30); Qwen3.5 the same.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .tiny_models import CONTEXT_LENGTH, EOS_TOKEN, PAD_TOKEN, _tokenizer_config, ensure_built
from .tiny_vlm import PREPROCESSOR, TEXT_VOCAB, chatml_template, tokenizer_with

TINY_FAMILIES_VERSION = 1
# gemma3: 2 = a random multi-modal projection (mlx-vlm initialises it with ones)
GEMMA3_VERSION = 2
GEMMA3_IMAGE_SIZE, GEMMA3_PATCH, GEMMA3_TOKENS = 48, 4, 36
QWEN_PATCH, QWEN_MERGE, QWEN_GRID = 4, 2, 12  # patches per side at the fixed resolution
QWEN_TOKENS = (QWEN_GRID // QWEN_MERGE) ** 2

GEMMA3_TOKENS_ADDED = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")
QWEN_TOKENS_ADDED = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")


def gemma3_config(ids: dict[str, int]) -> dict[str, Any]:
    return {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"],
        "image_token_index": ids["<image_soft_token>"],
        "mm_tokens_per_image": GEMMA3_TOKENS,
        "pad_token_id": ids[PAD_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "vocab_size": TEXT_VOCAB,
        "text_config": {
            "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "query_pre_attn_scalar": 16, "rms_norm_eps": 1e-6,
            "vocab_size": TEXT_VOCAB, "sliding_window": 512, "sliding_window_pattern": 2,
            "rope_global_base_freq": 1_000_000.0, "rope_local_base_freq": 10_000.0,
            "mm_tokens_per_image": GEMMA3_TOKENS, "max_position_embeddings": CONTEXT_LENGTH,
        },
        "vision_config": {
            "model_type": "siglip_vision_model", "num_hidden_layers": 2, "hidden_size": 32,
            "intermediate_size": 64, "num_attention_heads": 2, "patch_size": GEMMA3_PATCH,
            "image_size": GEMMA3_IMAGE_SIZE, "layer_norm_eps": 1e-6,
        },
    }


def qwen3_vl_config(ids: dict[str, int]) -> dict[str, Any]:
    return {
        "model_type": "qwen3_vl",
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": ids[EOS_TOKEN],
        "vocab_size": TEXT_VOCAB,
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "qwen3_vl", "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": TEXT_VOCAB,
            "rope_theta": 10_000.0, "max_position_embeddings": CONTEXT_LENGTH,
            "tie_word_embeddings": True,
            "rope_scaling": {"rope_type": "default", "mrope_section": [4, 2, 2],
                             "mrope_interleaved": True},
        },
        "vision_config": {
            "model_type": "qwen3_vl", "depth": 2, "hidden_size": 32, "intermediate_size": 64,
            "out_hidden_size": 64, "num_heads": 2, "patch_size": QWEN_PATCH,
            "spatial_merge_size": QWEN_MERGE, "temporal_patch_size": 2, "in_channels": 3,
            "num_position_embeddings": QWEN_GRID * QWEN_GRID,
            "deepstack_visual_indexes": [0, 1],
        },
    }


def qwen3_5_config(ids: dict[str, int], *, moe: bool = False) -> dict[str, Any]:
    """Qwen3.5 as it ships (``Qwen3_5ForConditionalGeneration``: ``text_config`` +
    ``vision_config``), at small sizes."""
    text: dict[str, Any] = {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "full_attention_interval": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
        "vocab_size": TEXT_VOCAB, "max_position_embeddings": CONTEXT_LENGTH,
        "tie_word_embeddings": False, "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1],
                            "mrope_interleaved": True, "rope_theta": 10_000.0,
                            "partial_rotary_factor": 0.5},
    }
    if moe:
        text.update({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                     "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1,
                     "norm_topk_prob": True})
    return {
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe
                          else "Qwen3_5ForConditionalGeneration"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": ids[EOS_TOKEN],
        "vocab_size": TEXT_VOCAB,
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {
            "model_type": "qwen3_5_moe" if moe else "qwen3_5", "depth": 2, "hidden_size": 32,
            "intermediate_size": 64, "out_hidden_size": 64, "num_heads": 2,
            "patch_size": QWEN_PATCH, "spatial_merge_size": QWEN_MERGE,
            "temporal_patch_size": 2, "in_channels": 3,
            "num_position_embeddings": QWEN_GRID * QWEN_GRID, "deepstack_visual_indexes": [],
        },
    }


def _build(out_dir: str | os.PathLike[str], family: str, seed: int) -> Path:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise ValueError(f"output folder {out} is not empty")
    added = GEMMA3_TOKENS_ADDED if family == "gemma3" else QWEN_TOKENS_ADDED
    tok_text = tokenizer_with(added)
    tok = json.loads(tok_text)
    ids = {t["content"]: int(t["id"]) for t in tok["added_tokens"]}
    if family == "gemma3":
        config = gemma3_config(ids)
        side = GEMMA3_IMAGE_SIZE
        image_text = "<start_of_image>"
        pre = {**PREPROCESSOR, "image_processor_type": "Gemma3ImageProcessor",
               "size": {"height": side, "width": side}, "do_center_crop": False,
               "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
               "do_pan_and_scan": False, "resample": 2}
        pre.pop("crop_size")
        proc = {"processor_class": "Gemma3Processor", "image_seq_length": GEMMA3_TOKENS}
    else:
        config = (qwen3_vl_config(ids) if family == "qwen3_vl"
                  else qwen3_5_config(ids, moe=family == "qwen3_5_moe"))
        side = QWEN_GRID * QWEN_PATCH
        image_text = "".join(QWEN_TOKENS_ADDED[:3])
        pre = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": QWEN_PATCH,
               "merge_size": QWEN_MERGE, "temporal_patch_size": 2,
               "size": {"shortest_edge": side * side, "longest_edge": side * side},
               "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
               "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
               "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True}
        proc = {"processor_class": "Qwen3VLProcessor"}  # as Qwen3.5 ships too
    arch, _ = get_model_and_args(config)
    model_config = update_module_configs(arch.ModelConfig.from_dict(config), arch, config,
                                         ["text", "vision"])
    mx.random.seed(seed)
    model = arch.Model(model_config)
    if family == "gemma3":
        # mlx-vlm initialises the projector with ones: every feature is then the sum of
        # a normed vector, ~0 by cancellation, so an image's direction after the text
        # model's norms is rounding noise (it flipped with the BLAS's summation order).
        # A random projection, as trained weights have, is well-conditioned.
        proj = model.multi_modal_projector
        shape = proj.mm_input_projection_weight.shape
        proj.mm_input_projection_weight = mx.random.normal(shape) / float(shape[0]) ** 0.5
    weights = {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())}
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "tokenizer.json").write_text(tok_text)
    tcfg = _tokenizer_config(tok, CONTEXT_LENGTH)
    tcfg["chat_template"] = chatml_template(image_text)
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2) + "\n")
    (out / "processor_config.json").write_text(json.dumps(proc, indent=2) + "\n")
    return out


def build_tiny_gemma3_vlm(out_dir: str | os.PathLike[str], seed: int = 2003) -> Path:
    return _build(out_dir, "gemma3", seed)


def build_tiny_qwen3_vl(out_dir: str | os.PathLike[str], seed: int = 2005) -> Path:
    return _build(out_dir, "qwen3_vl", seed)


def ensure_tiny_gemma3_vlm(cache_root: str | os.PathLike[str]) -> Path:
    return ensure_built(Path(cache_root) / f"tiny-gemma3-vlm-v{GEMMA3_VERSION}",
                        build_tiny_gemma3_vlm)


def ensure_tiny_qwen3_vl(cache_root: str | os.PathLike[str]) -> Path:
    return ensure_built(Path(cache_root) / f"tiny-qwen3-vl-v{TINY_FAMILIES_VERSION}",
                        build_tiny_qwen3_vl)


def build_tiny_qwen3_5_vlm(out_dir: str | os.PathLike[str], seed: int = 2007) -> Path:
    return _build(out_dir, "qwen3_5", seed)


def build_tiny_qwen3_5_moe_vlm(out_dir: str | os.PathLike[str], seed: int = 2009) -> Path:
    return _build(out_dir, "qwen3_5_moe", seed)


def ensure_tiny_qwen3_5_vlm(cache_root: str | os.PathLike[str]) -> Path:
    return ensure_built(Path(cache_root) / f"tiny-qwen3-5-vlm-v{TINY_FAMILIES_VERSION}",
                        build_tiny_qwen3_5_vlm)


def ensure_tiny_qwen3_5_moe_vlm(cache_root: str | os.PathLike[str]) -> Path:
    return ensure_built(Path(cache_root) / f"tiny-qwen3-5-moe-vlm-v{TINY_FAMILIES_VERSION}",
                        build_tiny_qwen3_5_moe_vlm)
