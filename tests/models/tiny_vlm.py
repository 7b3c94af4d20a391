"""A tiny random-weight vision-language model for tests, built offline (mlx-vlm llava).

The folder is a normal mlx-vlm model folder: ``config.json`` (``model_type: llava``
with a ``clip_vision_model`` vision tower and a ``llama`` text model),
``model.safetensors``, ``preprocessor_config.json`` (a CLIP image processor:
resize + center crop to ``IMAGE_SIZE``, normalise), ``processor_config.json`` and the
tiny models' tokenizer (``tiny_models.tokenizer_json``) with one extra special token,
``<image>``. Its ChatML template renders ``{"type": "image"}`` content parts and the
``<image>`` text the server puts into string contents alike, as one ``<image>`` token;
the engine expands it to ``TOKENS_PER_IMAGE`` placeholder tokens.

``IMAGE_SIZE / PATCH_SIZE = 8``: 64 patches, so an image covers 64 placeholder tokens
(with 16-token blocks: four whole blocks, or five when it does not start on a
boundary). Weights are float32, initialised from ``mx.random.seed``; mlx-vlm is
needed (``promptcache[vlm]``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .tiny_models import (
    CONTEXT_LENGTH,
    EOS_TOKEN,
    PAD_TOKEN,
    _tokenizer_config,
    ensure_built,
    tokenizer_json,
)

TINY_VLM_VERSION = 1
IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 32
PATCH_SIZE = 4
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2
TEXT_VOCAB = 1040  # the tokenizer's 1024 + <image>, rounded up

def chatml_template(image_text: str) -> str:
    """The tiny models' ChatML template; an image part renders as ``image_text``."""
    return (
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['content'] is string %}{{- message['content'] }}"
        "{%- elif message['content'] %}"
        "{%- for part in message['content'] %}"
        "{%- if part['type'] == 'text' %}{{- part['text'] }}"
        "{%- elif part['type'] == 'image' %}{{- '" + image_text + "' }}{%- endif %}"
        "{%- endfor %}"
        "{%- endif %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


CHATML_VLM_TEMPLATE = chatml_template(IMAGE_TOKEN)

PREPROCESSOR = {
    "image_processor_type": "CLIPImageProcessor",
    "do_resize": True,
    "size": {"shortest_edge": IMAGE_SIZE},
    "do_center_crop": True,
    "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "resample": 3,
    "do_convert_rgb": True,
}


def tokenizer_with(extra: tuple[str, ...]) -> str:
    """The tiny models' tokenizer.json with ``extra`` special tokens appended (ids after
    the last one, in order; they fit in ``TEXT_VOCAB``)."""
    tok = json.loads(tokenizer_json())
    next_id = max(max(int(t["id"]) for t in tok["added_tokens"]),
                  max(tok["model"]["vocab"].values())) + 1
    for i, content in enumerate(extra):
        tok["added_tokens"].append({
            "id": next_id + i, "content": content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": True,
        })
    if next_id + len(extra) > TEXT_VOCAB:
        raise ValueError(f"{len(extra)} extra tokens do not fit in {TEXT_VOCAB}")
    return json.dumps(tok)


def _tokenizer_with_image() -> tuple[str, int]:
    text = tokenizer_with((IMAGE_TOKEN,))
    return text, int(json.loads(text)["added_tokens"][-1]["id"])


def vlm_config(image_id: int, special_ids: dict[str, int], *, image_size: int = IMAGE_SIZE,
               patch_size: int = PATCH_SIZE, vision_layers: int = 2, vision_hidden: int = 32,
               text_layers: int = 2, text_hidden: int = 64) -> dict[str, Any]:
    return {
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "image_token_index": image_id,
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2,
        "vocab_size": TEXT_VOCAB,
        "eos_token_id": special_ids[EOS_TOKEN],
        "text_config": {
            "model_type": "llama", "hidden_size": text_hidden, "num_hidden_layers": text_layers,
            "intermediate_size": 2 * text_hidden, "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": TEXT_VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": CONTEXT_LENGTH, "tie_word_embeddings": True,
        },
        "vision_config": {
            "model_type": "clip_vision_model", "num_hidden_layers": vision_layers,
            "hidden_size": vision_hidden, "intermediate_size": 2 * vision_hidden,
            "num_attention_heads": 2, "image_size": image_size, "patch_size": patch_size,
            "projection_dim": vision_hidden, "layer_norm_eps": 1e-5,
        },
    }


def build_tiny_vlm(out_dir: str | os.PathLike[str], seed: int = 2001, **sizes: int) -> Path:
    """Write the tiny llava model into ``out_dir`` (created; must be empty). ``sizes``
    (``vlm_config``'s keywords) make a larger random model, e.g. for benchmarks."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise ValueError(f"output folder {out} is not empty")
    tok_text, image_id = _tokenizer_with_image()
    tok = json.loads(tok_text)
    special = {t["content"]: int(t["id"]) for t in tok["added_tokens"]}
    config = vlm_config(image_id, special, **sizes)
    size = int(config["vision_config"]["image_size"])
    arch, _ = get_model_and_args(config)
    model_config = update_module_configs(arch.ModelConfig.from_dict(config), arch, config,
                                         ["text", "vision"])
    mx.random.seed(seed)
    model = arch.Model(model_config)
    weights = {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())}
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "tokenizer.json").write_text(tok_text)
    tcfg = _tokenizer_config(tok, CONTEXT_LENGTH)
    tcfg["chat_template"] = CHATML_VLM_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}, indent=2) + "\n")
    pre = {**PREPROCESSOR, "size": {"shortest_edge": size},
           "crop_size": {"height": size, "width": size}}
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2) + "\n")
    (out / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaProcessor",
        "patch_size": int(config["vision_config"]["patch_size"]),
        "vision_feature_select_strategy": "default", "image_token": IMAGE_TOKEN,
        "num_additional_image_tokens": 1}, indent=2) + "\n")
    return out


def ensure_tiny_vlm(cache_root: str | os.PathLike[str]) -> Path:
    """``cache_root/tiny-llava-v<N>``, built first (into a temporary folder, renamed)."""
    return ensure_built(Path(cache_root) / f"tiny-llava-v{TINY_VLM_VERSION}", build_tiny_vlm)
